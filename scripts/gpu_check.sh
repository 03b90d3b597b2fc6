#!/usr/bin/env bash
# Issue 22 §7: the engine on a GPU, in one prepared run (a lent GPU's minutes are few).
#
#   OUT=results/gpu SHAPE=.shape bash scripts/gpu_check.sh
#
# SHAPE holds cache/<the bundled folder>/ with its config.json and tokenizer files only (11 MB):
# the weights (2.4 GB) cannot travel to a lent GPU, so the models here are the bundled model's
# shape and Qwen2.5-1.5B's (the article's) with seeded random weights (scripts/shaped_model.py),
# which cost what the real ones cost when every answer has its drawn length (the benchmarks make
# it so). In order, each step bounded in time so that one hang leaves the rest their turn:
# the machine; the two models; the engine's tests with the `exact` model on the GPU (the best
# device found, as a user's would be; TESTS picks them); the step profile (PROFILE=0 leaves it
# out); the interleaved equal-work QoE bar against `transformers serve --continuous-batching` on
# the same GPU, for each shape, with this server's defaults for the device unless SERVER_ARGS
# says otherwise, each load cut at LOAD_LIMIT seconds a server (a row then says how many of its
# readers were cut; each bar saves qoe-partial.json after every load, so a step stopped at its time
# keeps what it measured). Packages the machine lacks (transformers serve's, this project's) travel as
# wheels in WHEELS (the device tool's notes say how to fetch them), installed under /tmp/site.
# The wheels the H200's image lacked on 2026-12-04 (its torch 2.11 and tokenizers serve; numpy,
# pyyaml, tqdm, h11, typer, rich, requests are there), fetched here with the device tool's
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl` line:
#   transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0 tomlkit hf-xet==1.8.0 httpx2==2.16.2
#   httpcore2==2.16.2 truststore idna==3.20 openai==3.60.0 distro jiter==0.19.0 sniffio==1.3.1
#   pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
#   typing_extensions==4.16.0 anyio==4.16.0 click==8.5.1 regex==2026.11.19 filelock==4.3.2
#   fsspec==2026.9.0 fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.55.0
#   redis==8.2.0 gguf==0.19.0        (29 wheels, 29 MB; the versions of this project's .venv)
# Writes its logs and results under OUT. Leaves out: quality (the weights are random).
set -u
OUT=${OUT:-results/gpu}
SHAPE=${SHAPE:-.shape}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
LOADS=${LOADS:---rates 16,32 --bursts 128 --seconds 8}   # the 0.5B shape's loads
LOADS15=${LOADS15:---rates 16 --bursts= --seconds 8}     # the 1.5B shape's (fewer: minutes are few)
SERVER_ARGS=${SERVER_ARGS:-}                          # none: the defaults sized for the device
LOAD_LIMIT=${LOAD_LIMIT:-40}  # s a load may run on a server: 8 s of arrivals, then a 300-token answer at ~60 ms a step
TESTS=${TESTS:-tests/test_engine.py tests/test_sharing.py}
PROFILE=${PROFILE:-1}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 LM_CACHE=$SHAPE/cache
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"  # the checkout's modules (client, lm), uninstalled there
export TOKENIZERS_PARALLELISM=false
SOURCE=$LM_CACHE/qwen2.5-coder-0.5b-instruct-q4_k_m
T0=$(date +%s)

step() {  # step SECONDS COMMAND...: one bounded step, its output to the terminal and OUT/log.txt
    local secs=$1
    shift
    echo "== [$(($(date +%s) - T0)) s] $* (at most $secs s)"
    timeout -k 5 "$secs" "$@" 2>&1 | grep -v "Loading weights\|Writing model shards" | tee -a "$OUT/log.txt"
    echo "== rc ${PIPESTATUS[0]}"
}

nvidia-smi -L
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
step 60 $PY scripts/shaped_model.py /tmp/m05 --source "$SOURCE" --device "$DEVICE"
step 90 $PY scripts/shaped_model.py /tmp/m15 --shape 1.5b --source "$SOURCE" --device "$DEVICE"
# shellcheck disable=SC2086 # TESTS is several paths and options
step 90 $PY -m pytest -q -p no:cacheprovider $TESTS
[ "$PROFILE" = 1 ] && step 90 $PY scripts/bench.py profile --model /tmp/m05 --device "$DEVICE" --results "$OUT/p05"
# shellcheck disable=SC2086 # LOADS is several options
step 250 $PY scripts/bench.py qoe --model /tmp/m05 --device "$DEVICE" $LOADS --settle 3 \
    --load-limit "$LOAD_LIMIT" --server-args "$SERVER_ARGS" --results "$OUT/q05"
# shellcheck disable=SC2086
step 160 $PY scripts/bench.py qoe --model /tmp/m15 --device "$DEVICE" $LOADS15 --settle 3 \
    --load-limit "$LOAD_LIMIT" --server-args "$SERVER_ARGS" --results "$OUT/q15"
echo "== done in $(($(date +%s) - T0)) s"
