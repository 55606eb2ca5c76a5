# benches/gpu/env.sh — sourced by run.sh, probe.sh and e2e.sh on the device machine: points
# LD_LIBRARY_PATH at the CUDA 13 libraries of torch's install (`nvlibs`: their folders; libcudnn
# too, which rtune loads at run time for its attention, kernels/cudnn_sdpa.cpp) and sets RTUNE to
# the binary, unpacked from benches/gpu/bin/rtune.xz when only that travelled. Needs PY
# (a python3).
nvlibs=$("$PY" -c 'import glob, os, nvidia
d = []
for r in nvidia.__path__:
    for f in sorted(glob.glob(os.path.join(r, "**", "lib*.so*"), recursive=True)):
        if os.path.basename(f).startswith(("libcublas", "libcurand", "libcudart", "libnvrtc", "libnccl", "libcudnn")) and os.path.dirname(f) not in d:
            d.append(os.path.dirname(f))
print(":".join(d))' 2>/dev/null || true)
[ -n "$nvlibs" ] && export LD_LIBRARY_PATH="$nvlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
RTUNE=${RTUNE:-benches/gpu/bin/rtune}
if [ ! -f "$RTUNE" ] && [ -f "$RTUNE.xz" ]; then
  "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$RTUNE.xz" /tmp/rtune && chmod +x /tmp/rtune && RTUNE=/tmp/rtune
fi
