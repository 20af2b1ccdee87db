#!/usr/bin/env bash
# Same-run regression check of a Python-side change: `resilient-comm bench recovery` and
# `bench collectives --quick` on the package of commit REV against the working tree's,
# alternated ROUNDS times, both with the working tree's built extension (_C). For changes that
# leave the C++ object code as it was (a refactor of the Python side, moved C++ files); a C++
# change needs both builds instead.
#
#   bash benchmarks/compare_python.sh REV [ROUNDS]     (about 5 min per round on 2 cores)
#
# JSON goes to /tmp/compare_python/<bench>-{old,new}-<round>.json; compare per round (the
# machine drifts between rounds more than within one).
set -euo pipefail
rev=${1:?usage: compare_python.sh REV [ROUNDS]}
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
old=/tmp/compare_python/tree
out=/tmp/compare_python
rm -rf "$old" && mkdir -p "$out"
git -C "$root" archive --prefix=tree/ "$rev" resilient_comm | tar -x -C "$out"
cp "$root"/resilient_comm/_C.*.so "$old/resilient_comm/"
cd "$out"  # not the checkout: its package would shadow PYTHONPATH's
for round in $(seq "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then pp=$out/tree; cli=$(test -f "$old/resilient_comm/cli.py" && echo resilient_comm.cli || echo resilient_comm.tools.cli)
    else pp=; cli=resilient_comm.tools.cli; fi
    echo "== round $round, $side ($([ $side = old ] && echo "$rev" || echo 'working tree')): recovery"
    PYTHONPATH=$pp timeout 900 "$py" -m "$cli" bench recovery --nprocs 4,8 --reps 5 --sigstop-reps 0 --no-torchrun \
      --no-scripts --json "$out/recovery-$side-$round.json" | tail -4
    echo "== round $round, $side: collectives"
    PYTHONPATH=$pp timeout 600 "$py" -m "$cli" bench collectives --quick --world-sizes 4 \
      --json "$out/collectives-$side-$round.json" | tail -4
  done
done
"$py" - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("| round | measure | before | after | after / before |\n|---|---|---|---|---|")
for rd in range(1, rounds + 1):
    rec = {s: json.load(open(f"{out}/recovery-{s}-{rd}.json"))["runs"] for s in ("old", "new")}
    for n in (4, 8):
        a, b = (st.median(r["first_commit_s"] * 1e3 for r in rec[s] if r["nproc"] == n and r["recovered"])
                for s in ("old", "new"))
        print(f"| {rd} | SIGKILL -> first commit, {n} ranks | {a:.1f} ms | {b:.1f} ms | {b / a:.2f} |")
    col = {s: json.load(open(f"{out}/collectives-{s}-{rd}.json"))["results"] for s in ("old", "new")}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for nb, label in ((8, "8 B"), (1 << 20, "1 MiB")):
            a, b = (next(r["ours"]["time_s"] * 1e6 for r in col[s] if r["op"] == op and r["nominal_bytes"] == nb)
                    for s in ("old", "new"))
            print(f"| {rd} | {op} {label}, 4 ranks | {a:.0f} us | {b:.0f} us | {b / a:.2f} |")
PY
