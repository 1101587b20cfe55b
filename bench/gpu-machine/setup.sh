# Sourced on the GPU machine from the repository root, from the folder pack.sh filled (carried):
# llama.cpp's CUDA libraries and llama-server (scripts/cuda-libs.sh), gguf-py, the binaries, and
# the timing pairs named in PAIRS (default smolvlm-500m). Sets t0, LD_LIBRARY_PATH,
# VLM_LLAMA_SERVER and PATH (/tmp/bin).
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$D"/whl/*.whl \
    && export PYTHONPATH=/tmp/site
# CUDA libraries an earlier machine of the session built and save-cuda.sh brought back.
# (Without llama-server where only the libraries were carried: the elements' runs need no peer.
# Its binary and the two libraries it adds, 2.6 MB as xz, can travel beside them as
# server-libs.tar.xz: `tar cJf server-libs.tar.xz llama-server libllama-common.so* libllama-server-impl.so`
# in the unpacked folder.)
cuda_lib=/tmp/cuda/build/bin/libggml-cuda.so
if [ ! -e $cuda_lib ] && [ -s "$D/cuda-libs.tar.xz" ]; then
    mkdir -p /tmp/cuda/build/bin && tar xJf "$D/cuda-libs.tar.xz" -C /tmp/cuda/build/bin
fi
if [ -s "$D/server-libs.tar.xz" ] && [ ! -e /tmp/cuda/build/bin/llama-server ]; then
    mkdir -p /tmp/cuda/build/bin && tar xJf "$D/server-libs.tar.xz" -C /tmp/cuda/build/bin
fi
if [ ! -e $cuda_lib ]; then
    JOBS=$(nproc) scripts/cuda-libs.sh "$D/llama.cpp.tar.xz" /tmp/cuda > /tmp/cuda-build.log 2>&1 \
        || { tail -30 /tmp/cuda-build.log; return 1; }
fi
echo "[setup] CUDA libraries $(( $(date +%s) - t0 )) s"
export LD_LIBRARY_PATH=/tmp/cuda/build/bin VLM_LLAMA_SERVER=/tmp/cuda/build/bin/llama-server
mkdir -p /tmp/bin
for b in "$D"/*.xz; do
    case $b in *llama.cpp* | *cuda-libs*) continue ;; esac
    xz -dc "$b" > "/tmp/bin/$(basename "$b" .xz)" && chmod +x "/tmp/bin/$(basename "$b" .xz)"
done
export PATH=/tmp/bin:$PATH
mkdir -p models
[ -s models/SmolLM2-135M-Instruct.Q4_1.gguf ] || cp "$D/smollm2-tokenizer.gguf" models/SmolLM2-135M-Instruct.Q4_1.gguf
for pair in ${PAIRS:-smolvlm-500m}; do
    [ -s "models/timing/$pair-mmproj.gguf" ] || python3 scripts/make_timing_pair.py "$pair" --out-dir models/timing 2>&1 | tail -1
done
echo "[setup] ready $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
