"""gpupool as ONNX Runtime's CUDA allocator, through the CUDA execution provider's external
allocator options (docs/onnxruntime.md).

    import onnxruntime as ort, gpupool
    session = ort.InferenceSession(model, providers=[
        ("CUDAExecutionProvider", gpupool.onnxruntime.provider_options()),
    ])

The options hand ONNX Runtime the addresses of gpupool_ort_alloc, gpupool_ort_free and
gpupool_ort_empty_cache (include/gpupool_plugins.h) as its gpu_external_alloc,
gpu_external_free and gpu_external_empty_cache. ONNX Runtime's external allocator has no stream
argument: gpupool files the blocks under the stream set_stream() names (the legacy default
stream unless set), which should be the session's compute stream (the provider's
user_compute_stream option).
"""

import ctypes

from . import _lib


def _address(name):
    return ctypes.cast(getattr(_lib.lib(), name), ctypes.c_void_p).value


def provider_options(stream=None, **options):
    """The CUDA execution provider's options that make gpupool its device allocator, as strings
    (ONNX Runtime parses the addresses), merged with `options` (device_id, ...). `stream`: the
    compute stream to file blocks under (set_stream), also passed as user_compute_stream when
    given."""
    opts = {str(k): str(v) for k, v in options.items()}
    opts.update({
        "gpu_external_alloc": str(_address("gpupool_ort_alloc")),
        "gpu_external_free": str(_address("gpupool_ort_free")),
        "gpu_external_empty_cache": str(_address("gpupool_ort_empty_cache")),
    })
    if stream is not None:
        handle = set_stream(stream)
        opts["has_user_compute_stream"] = "1"
        opts["user_compute_stream"] = str(handle)
    return opts


def set_stream(stream):
    """Files gpupool_ort_alloc's blocks from now on under `stream` (a cudaStream_t value or a
    framework's stream object; None or 0 the legacy default stream). Process-wide. Returns the
    handle as an int."""
    handle = _lib.stream_handle(stream)
    lib = _lib.lib()
    lib.gpupool_ort_set_stream.argtypes = [ctypes.c_void_p]
    lib.gpupool_ort_set_stream.restype = ctypes.c_uint32
    _lib.check(lib.gpupool_ort_set_stream(handle), "gpupool_ort_set_stream")
    return handle
