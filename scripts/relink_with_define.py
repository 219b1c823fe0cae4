"""A second copy of one shared library of a CMake build, one of its sources compiled again with a
further define, the rest of its objects reused: for scripts/gpu_llama.sh, where ggml's CUDA
backend with the legacy memory pool (GGML_CUDA_NO_VMM) differs from the default build in
ggml-cuda.cu alone, whose compilation takes a minute, where building the whole backend twice
would take most of the GPU machine's ten minutes.

    python3 scripts/relink_with_define.py BUILD TARGET SOURCE DEFINE OUT_DIR [compile|link]

BUILD: a build folder configured with CMAKE_EXPORT_COMPILE_COMMANDS=ON (Makefile generator)
and built; TARGET: the library target (ggml-cuda); SOURCE: the end of the source's path
(ggml-cuda/ggml-cuda.cu); DEFINE: the macro to add (GGML_CUDA_NO_VMM); OUT_DIR: where the
library goes, under the file name and with the symbolic links that BUILD/bin has for it, so that
LD_LIBRARY_PATH=OUT_DIR puts it ahead of the RUNPATH's copy. The object is compiled with the
build's own command line (compile_commands.json) and linked with the target's link.txt, both
run from the folder CMake runs them in. Only valid when the define changes nothing that the other
objects share (a struct's layout, an inline function): ggml-cuda's GGML_CUDA_NO_VMM changes only
which pool ggml-cuda.cu creates (common.cuh defines GGML_USE_VMM from it; the device info
keeps its vmm fields either way). `compile` only compiles (it needs the build configured, not
built: it can run beside the build), `link` only links (the object compiled before, the build
done); both when left out. Exit status 1, with the reason, when a step fails.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys


def main():
    if len(sys.argv) not in (6, 7) or sys.argv[6:] not in ([], ["compile"], ["link"]):
        sys.exit(__doc__.split("\n\n")[1])
    build, target, source, define, out_dir = sys.argv[1:6]
    step = sys.argv[6] if len(sys.argv) == 7 else "all"
    build, out_dir = os.path.abspath(build), os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    entries = [e for e in json.load(open(os.path.join(build, "compile_commands.json"))) if e["file"].endswith(source)]
    if len(entries) != 1:
        sys.exit(f"{len(entries)} compile commands for {source} in {build}/compile_commands.json: expected 1")
    e = entries[0]
    cmd = e["command"] if "command" in e else shlex.join(e["arguments"])
    m = re.search(r"\s-o\s+(\S+)", cmd)
    if not m:
        sys.exit(f"no -o in the compile command of {source}: {cmd}")
    obj = m.group(1)
    new_obj = os.path.join(out_dir, os.path.basename(obj))
    # Every mention of the object (-o, and the dependency file's -MT/-MF) moves to OUT_DIR.
    new_cmd = cmd.replace(obj, new_obj).replace(" -c ", f" -D{define} -c ", 1)
    if f"-D{define}" not in new_cmd:
        sys.exit(f"no ' -c ' in the compile command of {source}, to put -D{define} before: {cmd}")
    if step != "link":
        print(f"compiling {source} with -D{define}", flush=True)
        if subprocess.run(new_cmd, shell=True, cwd=e["directory"]).returncode != 0:
            sys.exit(f"{source} did not compile with -D{define}")
        if step == "compile":
            return
    if not os.path.exists(new_obj):
        sys.exit(f"no {new_obj}: compile it first")
    links = glob.glob(os.path.join(build, "**", f"{target}.dir", "link.txt"), recursive=True)
    if len(links) != 1:
        sys.exit(f"{len(links)} link.txt for {target} under {build}: expected 1 (the Makefile generator's)")
    link_dir = os.path.dirname(os.path.dirname(os.path.dirname(links[0])))  # the target's folder
    lines = [l for l in open(links[0]).read().splitlines() if l.strip()]
    # With many objects CMake lists them in response files (@CMakeFiles/X.dir/objects1.rsp):
    # the one naming the object is copied to OUT_DIR with the new object, and named instead.
    rsp_swap = {}
    for line in lines:
        for ref in re.findall(r"@(\S+\.rsp)", line):
            path = os.path.join(link_dir, ref)
            text = open(path).read() if os.path.exists(path) else ""
            if obj in text:
                copy = os.path.join(out_dir, os.path.basename(ref))
                open(copy, "w").write(text.replace(obj, new_obj))
                rsp_swap["@" + ref] = "@" + copy
    if not rsp_swap and not any(obj in l for l in lines):
        sys.exit(f"{obj} is not in {links[0]} nor in a response file it names")
    for line in lines:
        line = line.replace(obj, new_obj)
        for old_ref, new_ref in rsp_swap.items():
            line = line.replace(old_ref, new_ref)
        out = re.search(r"\s-o\s+(\S+)", line)
        if out:
            lib = os.path.normpath(os.path.join(link_dir, out.group(1).strip('"')))
            line = line.replace(out.group(0), f" -o {os.path.join(out_dir, os.path.basename(lib))}", 1)
            # The symbolic links the build made for it (libX.so, libX.so.0), made again in OUT_DIR.
            for p in glob.glob(os.path.join(os.path.dirname(lib), f"lib{target}.so*")):
                if os.path.islink(p):
                    dst = os.path.join(out_dir, os.path.basename(p))
                    if os.path.lexists(dst):
                        os.remove(dst)
                    os.symlink(os.readlink(p), dst)
        if subprocess.run(line, shell=True, cwd=link_dir).returncode != 0:
            sys.exit(f"linking {target} failed: {line}")
    made = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out_dir, f"lib{target}.so*")))
    if not made:
        sys.exit(f"no lib{target}.so* in {out_dir} after the link")
    print(f"{out_dir}: {' '.join(made)}")


if __name__ == "__main__":
    main()
