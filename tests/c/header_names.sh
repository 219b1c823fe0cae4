#!/bin/sh
# Every name gpupool's headers declare starts with gpupool_ or GPUPOOL_ (CUstream_st is CUDA's
# own name for a stream, declared the way cuda.h does), and gpupool.h declares none of the
# simulated device's, PyTorch's, CuPy's or ONNX Runtime's functions: what test_header_names.c cannot list, a new
# name leaking from the Rust core, fails here.
#   tests/c/header_names.sh include/gpupool.h include/gpupool_testing.h include/gpupool_torch.h include/gpupool_plugins.h
set -eu
status=0
for header in "$@"; do
  # The declarations, without comments: /** ... */ blocks and // and /* */ tails.
  code=$(sed -e '/^ *\/\*/,/\*\//d' -e 's|//.*||' -e 's|/\*.*\*/||' "$header")
  names=$(printf '%s\n' "$code" | sed -n \
    -e 's/^#define \([A-Za-z_][A-Za-z0-9_]*\).*/\1/p' \
    -e 's/^typedef .*[ *]\([A-Za-z_][A-Za-z0-9_]*\);$/\1/p' \
    -e 's/^\(typedef \)\{0,1\}\(struct\|enum\|union\) \([A-Za-z_][A-Za-z0-9_]*\).*/\3/p' \
    -e 's/^ *\([A-Za-z_][A-Za-z0-9_]*\) = .*/\1/p' \
    -e 's/^[A-Za-z_].*[ *]\([A-Za-z_][A-Za-z0-9_]*\)(.*);$/\1/p')
  if [ -z "$names" ]; then
    echo "$header: no declarations found" >&2
    status=1
  fi
  for name in $names; do
    case "$name" in
      gpupool_* | GPUPOOL_* | CUstream_st) ;;
      *) echo "$header: declares $name, which is not gpupool_ or GPUPOOL_ prefixed" >&2; status=1 ;;
    esac
  done
  case "$(basename "$header")" in
    gpupool.h)
      if printf '%s\n' "$names" | grep -E '^gpupool_(sim|torch|cupy|ort)_'; then
        echo "$header: the functions above belong in gpupool_testing.h, gpupool_torch.h or gpupool_plugins.h" >&2
        status=1
      fi ;;
  esac
  echo "$header: $(printf '%s\n' "$names" | wc -l) names"
done
exit $status
