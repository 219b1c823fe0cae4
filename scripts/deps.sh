# Sourced by run.sh, test.sh and .ci/run: installs what a fresh machine lacks to build
# gpupool (cmake and pkg-config from Debian/Ubuntu packages, and python3-venv for the Python
# package's test). Needs cargo and a C compiler.
if ! command -v cargo >/dev/null 2>&1; then
  echo "gpupool needs a Rust toolchain (cargo): see https://rustup.rs" >&2
  exit 1
fi
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v cc >/dev/null 2>&1 || missing+=(build-essential)
# The Python package's test (test.sh) builds its wheel in a virtual environment.
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
