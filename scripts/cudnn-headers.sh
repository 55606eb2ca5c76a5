#!/usr/bin/env bash
# Puts the headers kernels/cudnn_sdpa.cpp compiles against into a cache and prints the one line
# that points the build at them:
#   export RTUNE_CUDNN_INCLUDE=<frontend>:<cudnn>:<nvrtc>
# (crates/backend/build.rs compiles the shim only when RTUNE_CUDNN_INCLUDE is set.)
#   - cudnn-frontend 1.32 (header-only graph API): PyPI `nvidia-cudnn-frontend`, its include/;
#   - cuDNN 9's C headers: PyPI `nvidia-cudnn-cu13`, nvidia/cudnn/include/ (the libraries are not
#     kept: cuDNN is loaded at run time, never linked);
#   - nvrtc.h (the front end includes it): PyPI `nvidia-cuda-nvrtc` 13.0, nvidia/cu13/include/.
# The wheels are downloaded once (~530 MB, most of it cuDNN's libraries: ~10 s on the dev box's
# mirror), only their headers are unpacked, and the wheels are deleted; a warm cache costs nothing.
# The CUDA runtime headers come from the nvcc of scripts/check-kernels.sh (or the CUDA toolchain).
#
#   eval "$(scripts/cudnn-headers.sh)"
set -euo pipefail
home=${RTUNE_CUDNN_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune-cudnn}
fe=$home/frontend/include
dnn=$home/cudnn/include
rtc=$home/nvrtc/include
if [ ! -f "$fe/cudnn_frontend.h" ] || [ ! -f "$dnn/cudnn_graph.h" ] || [ ! -f "$rtc/nvrtc.h" ]; then
  echo "cudnn-headers: fetching cudnn-frontend, cuDNN 9 and nvrtc headers into $home" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" \
    "nvidia-cudnn-frontend==1.32.*" "nvidia-cudnn-cu13==9.*" "nvidia-cuda-nvrtc==13.0.*" >&2
  rm -rf "$home/frontend" "$home/cudnn" "$home/nvrtc"
  mkdir -p "$home/frontend" "$home/cudnn" "$home/nvrtc"
  python3 - "$tmp" "$home" <<'PY'
import sys, zipfile, pathlib
tmp, home = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
# (wheel name prefix, path prefix inside the wheel, destination)
want = [("nvidia_cudnn_frontend", "include/", home / "frontend/include"),
        ("nvidia_cudnn_cu13", "nvidia/cudnn/include/", home / "cudnn/include"),
        ("nvidia_cuda_nvrtc", "nvidia/cu13/include/", home / "nvrtc/include")]
for prefix, inner, dest in want:
    (whl,) = [w for w in tmp.glob("*.whl") if w.name.startswith(prefix + "-")]
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.startswith(inner) and not name.endswith("/"):
                rel = pathlib.PurePosixPath(name[len(inner):])
                if ".." in rel.parts:
                    sys.exit(f"cudnn-headers: {whl.name} has a path outside its include/: {name}")
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
PY
fi
echo "export RTUNE_CUDNN_INCLUDE=\"$fe:$dnn:$rtc\""
