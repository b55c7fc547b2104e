# Sourced by scripts/build-cuda and scripts/ci-cuda-check: the PyPI pins of the CUDA
# toolchain and link libraries, and the one function that installs them. The caller
# defines `log` (one line to stderr) and sets PYTHON.
#
# The toolchain set is the one verified in /work/shared/cuda-build.md; all five must be
# installed by ONE pip call (a second `pip --target` call replaces the tree). CUDA 13.0
# matches the lent machines' 580 driver; a newer nvcc emits PTX that driver refuses.
TOOLCHAIN_PKGS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-cccl==13.0.85
)
# Link-time libraries: CUDA 13.0-era releases. NCCL is the oldest CUDA-13 build, so
# every NCCL symbol the binary references exists in any newer libnccl.so.2 it meets.
LINK_PKGS=(
    nvidia-cublas==13.0.2.14
    nvidia-curand==10.4.0.35
    nvidia-cuda-nvrtc==13.0.88
    nvidia-nccl-cu13==2.27.7
)

# pip_into DIR PKG... : one `pip install --target` call, redone only when the pins change
# or a previous attempt did not finish (no marker). Installs into DIR.tmp, then renames.
pip_into() {
    local dir="$1"
    shift
    local want
    want="$(printf '%s\n' "$@")"
    if [[ -f "$dir/.mold-pins" && "$(cat "$dir/.mold-pins")" == "$want" ]]; then
        return 0
    fi
    log "pip install into $dir: $*"
    rm -rf "$dir.tmp"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --target "$dir.tmp" "$@" >&2
    printf '%s\n' "$want" >"$dir.tmp/.mold-pins"
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
}
