#!/usr/bin/env bash
# End-to-end check of the SGLang path on a GPU machine. NOT RUN YET: no GPU was available where
# it was written; until someone runs it, the GPU path is unverified (see docs/sglang.md).
#
# Needs: one or more CUDA GPUs, SGLang 0.5.21 (full CUDA install) and eagle3d in the same Python:
#   pip install "sglang==0.5.21" && pip install --no-deps -e /path/to/eagle3d
# Run:   scripts/gpu_check_sglang.sh            (env: PYTHON, WORK, SAMPLES=300, TP=1, PORT=30123)
#
# Steps: build a small Llama checkpoint (eagle3d tiny-model, 8 layers, hidden 1024), start
# `eagle3d serve-sglang` (bf16), extract SAMPLES samples with `eagle3d run --backend sglang`,
# `eagle3d verify`, compare every sample with a Hugging Face forward (fp32 reference, bf16
# tolerance), then restart SGLang *without* the hook, send the same token ids as plain
# one-token /generate requests, and print eagle3d's prompt tokens/s against that baseline, both
# read from SGLang's own /metrics (sglang:prompt_tokens_total).
set -euo pipefail
PY="${PYTHON:-python}"
WORK="${WORK:-$(mktemp -d -t eagle3d-gpu-check.XXXX)}"
SAMPLES="${SAMPLES:-300}"
TP="${TP:-1}"
PORT="${PORT:-30123}"
URL="http://127.0.0.1:$PORT"
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$WORK"
echo "gpu_check_sglang: work dir $WORK"
"$PY" -c 'import sglang, torch; assert torch.cuda.is_available(), "no CUDA"; print("sglang", sglang.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())'

server_pid=""
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"; wait "$server_pid" || true
  fi
  server_pid=""
}
trap stop_server EXIT

wait_ready() {  # /health answers without generating (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false)
  for _ in $(seq 1 600); do
    if curl -sf "$URL/health" >/dev/null; then return 0; fi
    if ! kill -0 "$server_pid" 2>/dev/null; then echo "server died; see $1" >&2; tail -50 "$1" >&2; exit 1; fi
    sleep 1
  done
  echo "server not ready after 600 s; see $1" >&2; exit 1
}

prompt_tokens() { curl -sf "$URL/metrics" | awk '/^sglang:prompt_tokens_total/ {s += $NF} END {printf "%.0f\n", s}'; }

# 1. a small Llama checkpoint and a dataset of SAMPLES conversations
[ -f "$WORK/model/config.json" ] || "$PY" -m eagle3d tiny-model "$WORK/model" --layers 8 --hidden 1024 --heads 8 --kv-heads 4 --vocab 4000
"$PY" - "$root/daemon/eagle3d/data/demo.jsonl" "$WORK/data.jsonl" "$SAMPLES" <<'PY'
import sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = [l for l in open(src, encoding="utf-8") if l.strip()]
with open(dst, "w", encoding="utf-8") as f:
    f.writelines(lines[i % len(lines)] for i in range(n))
PY

common=(--model-path "$WORK/model" --port "$PORT" --tp "$TP" --dtype bfloat16 --mem-fraction-static 0.6)

# 2. SGLang with the capture hook, supervised by eagle3d
rm -rf "$WORK/dumps" "$WORK/out"
"$PY" -m eagle3d serve-sglang --python "$PY" --dump-dir "$WORK/dumps" -- "${common[@]}" >"$WORK/serve.log" 2>&1 &
server_pid=$!
wait_ready "$WORK/serve.log"

# 3. extraction
t0_tokens=$(prompt_tokens); t0=$(date +%s.%N)
"$PY" -m eagle3d run --backend sglang --server "$URL" --model "$WORK/model" --dataset "$WORK/data.jsonl" \
  --output "$WORK/out" --dump-dir "$WORK/dumps" --concurrency 64 2>&1 | tail -5
t1=$(date +%s.%N); t1_tokens=$(prompt_tokens)
stop_server
"$PY" -m eagle3d verify --output "$WORK/out"

# 4. compare with a Hugging Face forward (fp32 reference; the server ran bf16)
"$PY" - "$WORK/model" "$WORK/out" <<'PY'
import glob, sys, torch
from transformers import AutoModelForCausalLM
model_dir, out = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
n = m.config.num_hidden_layers
layers = [2, n // 2, n - 3]
worst, files = 1.0, sorted(glob.glob(f"{out}/rows_*/data_*.ckpt"))
for path in files:
    d = torch.load(path, weights_only=True)
    with torch.no_grad():
        hs = m.model(input_ids=d["input_ids"][None].cuda(), output_hidden_states=True).hidden_states
    ref_aux = torch.cat([hs[i] for i in layers], -1)[0].float()
    for got, ref in ((d["aux_hidden_state"][0].cuda().float(), ref_aux), (d["hidden_state"][0].cuda().float(), hs[-1][0].float())):
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        worst = min(worst, cos.min().item())
        rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()
        if cos.min().item() < 0.99 or rel > 0.08:
            sys.exit(f"MISMATCH {path}: min cosine {cos.min().item():.4f}, max relative error {rel:.4f}")
print(f"hf comparison: {len(files)} samples, min per-token cosine {worst:.5f} (bf16 tolerance: >= 0.99, rel err <= 0.08)")
PY

# 5. SGLang's own prefill rate on the same ids, without the hook
"$PY" -m sglang.launch_server "${common[@]}" --enable-metrics --disable-radix-cache >"$WORK/plain.log" 2>&1 &
server_pid=$!
wait_ready "$WORK/plain.log"
b0_tokens=$(prompt_tokens); b0=$(date +%s.%N)
"$PY" - "$WORK/out" "$URL" <<'PY'
import asyncio, glob, sys, torch, httpx
out, url = sys.argv[1], sys.argv[2]
ids = [torch.load(p, weights_only=True)["input_ids"].tolist() for p in sorted(glob.glob(f"{out}/rows_*/data_*.ckpt"))]
async def main():
    sem = asyncio.Semaphore(64)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def one(k, x):
            async with sem:
                r = await c.post("/generate", json={"input_ids": x, "rid": f"plain-{k}", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                r.raise_for_status()
        await asyncio.gather(*(one(k, x) for k, x in enumerate(ids)))
asyncio.run(main())
PY
b1=$(date +%s.%N); b1_tokens=$(prompt_tokens)
stop_server

"$PY" - "$t0" "$t1" "$t0_tokens" "$t1_tokens" "$b0" "$b1" "$b0_tokens" "$b1_tokens" <<'PY'
import sys
t0, t1, a0, a1, b0, b1, c0, c1 = map(float, sys.argv[1:])
ours = (a1 - a0) / (t1 - t0)
plain = (c1 - c0) / (b1 - b0)
print(f"eagle3d (hook + daemon, end to end): {a1 - a0:.0f} prompt tokens in {t1 - t0:.1f} s = {ours:,.0f} tok/s")
print(f"SGLang alone (same ids, /generate, no hook): {c1 - c0:.0f} prompt tokens in {b1 - b0:.1f} s = {plain:,.0f} tok/s")
print(f"ratio: {ours / plain:.2f}x of SGLang's own prefill rate (from /metrics sglang:prompt_tokens_total)")
PY
echo "gpu_check_sglang: OK ($WORK)"
