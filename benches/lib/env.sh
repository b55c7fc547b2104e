# Sourced by the device scripts in benches/: the GPU machine's environment and mold's binary.
#   gpu_env          CUDA libraries from the machine's PyTorch wheels (site-packages/nvidia/*/lib)
#                    on LD_LIBRARY_PATH, NVLink multicast off in NCCL (never change it there)
#   diffusers_wheels installs the diffusers wheels carried in .whl into /tmp/site (on
#                    PYTHONPATH) unless the machine's Python already has diffusers
#   mold_bin DIR     prints the binary to run: $MOLD when set (e.g. target/debug/mold for a dry run
#                    on emulated devices), else DIR/mold unpacked once from .carry/mold.gz
gpu_env() {
    local site d libs=""
    site="$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)" || site=""
    for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libs="${libs:+$libs:}$d"; done
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
}

mold_bin() {
    if [ -n "${MOLD:-}" ]; then echo "$MOLD"; return; fi
    local bin="$1/mold"
    if [ ! -x "$bin" ]; then
        gzip -dc .carry/mold.gz > "$bin" && chmod +x "$bin" || { echo "mold_bin: no .carry/mold.gz" >&2; return 1; }
    fi
    echo "$bin"
}

diffusers_wheels() {
    python3 -c "import diffusers" 2>/dev/null && return
    [ -d .whl ] || { echo "diffusers_wheels: no diffusers and no .whl (benches/parity/README.md)" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# smi_sample FILE: samples every GPU's clocks, power, temperature and clock-event (throttle)
# reasons every 200 ms into FILE (CSV, a read-only nvidia-smi query) in the background; prints
# the sampler's pid (kill it when done), nothing where there is no nvidia-smi.
smi_sample() {
    command -v nvidia-smi > /dev/null || return 0
    local reasons=clocks_event_reasons.active
    nvidia-smi --query-gpu=$reasons --format=csv,noheader > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
        --format=csv -lms 200 > "$1" 2>/dev/null &
    echo $!
}
