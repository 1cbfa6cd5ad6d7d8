#!/bin/bash
# cold and warm starts of ours against llama-server on the three files (issue 39)
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LS=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server built from source}
E=$($PY -c "from engine_worker.model.loader import embedded_gguf_path; print(embedded_gguf_path())")
Q05=~/.cache/kestrel/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
Q15=~/.cache/kestrel/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
for pair in "smollm2:$E" "qwen-0.5b:$Q05" "qwen-1.5b:$Q15"; do
  name=${pair%%:*}; f=${pair#*:}
  cold=$(mktemp -d); ln -s ~/.cache/kestrel/kernels $cold/kernels
  $PY benchmarks/start_time.py --llama-server $LS $f "$name llama-server"; sleep 2
  KESTREL_CACHE_DIR=$cold $PY benchmarks/start_time.py "$PWD" $f "$name kestrel cold"; sleep 2
  KESTREL_CACHE_DIR=$cold $PY benchmarks/start_time.py "$PWD" $f "$name kestrel second start (path choice checked again)"; sleep 2
  KESTREL_CACHE_DIR=$cold $PY benchmarks/start_time.py "$PWD" $f "$name kestrel warm"; sleep 2
  $PY benchmarks/start_time.py --llama-server $LS $f "$name llama-server"; sleep 2
  rm -rf $cold
done
