#!/usr/bin/env bash
# check_energy.sh BENCH WORK: energy in `twobp_bench pipeline` JSON end to end, on a powercap tree written here.
#  1. A RAPL package zone whose counter a background writer advances (atomic renames, as sysfs reads see whole
#     values): every result has energy_j > 0, j_per_token = energy_j / tokens per step, 2BP rows an energy_ratio,
#     and config.energy_source is "rapl".
#  2. An empty powercap root: energy_j and j_per_token are null (never 0) and config.energy_note says why.
set -euo pipefail
bench=$1 work=$2
rm -rf "$work" && mkdir -p "$work/powercap/intel-rapl:0" "$work/empty"
zone=$work/powercap/intel-rapl:0
echo package-0 > "$zone/name"
echo 1000000000000 > "$zone/max_energy_range_uj"
echo 0 > "$zone/energy_uj"
(
  uj=0
  while :; do
    uj=$((uj + 200000))  # 0.2 J per iteration
    echo "$uj" > "$zone/energy_uj.new" && mv "$zone/energy_uj.new" "$zone/energy_uj"
    sleep 0.002
  done
) &
writer=$!
trap 'kill $writer 2>/dev/null || true' EXIT
model=(--dim 64 --layers 2 --heads 2 --kv-heads 2 --ffn 128 --vocab 64 --seq 16 --micro-batch-size 2)
# 20 measured steps (tens of ms): long enough that the writer, a few ms per update, advances the counter within
# them even when a parallel ctest starves it for a while (with 5 steps the test failed once under ctest -j2, on
# 2026-12-03; its output was not kept, a starved writer is the likely cause).
"$bench" pipeline --ranks 2 --schedule 1f1b --mode both --microbatches 4 --steps 20 --warmup 1 "${model[@]}" \
  --powercap-root "$work/powercap" --json "$work/measured.json" > "$work/measured.log"
kill $writer
"$bench" pipeline --ranks 2 --schedule 1f1b --mode both --microbatches 4 --steps 2 --warmup 1 "${model[@]}" \
  --powercap-root "$work/empty" --json "$work/unmeasured.json" > "$work/unmeasured.log"
python3 - "$work/measured.json" "$work/unmeasured.json" <<'PY'
import json, math, sys
measured, unmeasured = (json.load(open(p)) for p in sys.argv[1:3])
problems = []
tokens = 4 * 2 * 16  # m * micro-batch size * seq
if measured["config"].get("energy_source") != "rapl":
    problems.append(f"measured: energy_source {measured['config'].get('energy_source')!r}, expected 'rapl'")
for r in measured["results"]:
    e, j = r.get("energy_j"), r.get("j_per_token")
    if not isinstance(e, (int, float)) or not e > 0:
        problems.append(f"measured {r['mode']}: energy_j {e!r}, expected > 0")
    elif not isinstance(j, (int, float)) or not math.isclose(j, e / tokens, rel_tol=1e-9):
        problems.append(f"measured {r['mode']}: j_per_token {j!r}, expected energy_j / {tokens} = {e / tokens}")
    if r["mode"] == "2bp" and not r.get("energy_ratio", 0) > 0:
        problems.append(f"measured 2bp: energy_ratio {r.get('energy_ratio')!r}, expected > 0")
for r in unmeasured["results"]:
    if r.get("energy_j", 0) is not None or r.get("j_per_token", 0) is not None:
        problems.append(f"unmeasured {r['mode']}: energy_j {r.get('energy_j')!r}, j_per_token "
                        f"{r.get('j_per_token')!r}, expected null")
if "no RAPL" not in unmeasured["config"].get("energy_note", ""):
    problems.append(f"unmeasured: energy_note {unmeasured['config'].get('energy_note')!r}, expected the reason")
if problems:
    sys.exit("energy in twobp_bench pipeline JSON:\n  " + "\n  ".join(problems))
print("energy: " + ", ".join(f"{r['mode']} {r['energy_j']:.3f} J/step" for r in measured["results"]))
PY
