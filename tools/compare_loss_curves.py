"""Compare the `lm loss` per iteration of two or more training logs (Megatron log lines).

    python tools/compare_loss_curves.py reference.log other.log [more.log ...] [--from-iter N]

Prints, for each other log, the iterations both logs have, the largest absolute and relative difference,
the mean signed difference (a drift shows here, noise averages out) and the loss at the last common
iteration of both.
"""
import argparse
import re
import statistics

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.E+-]+) \|")


def read_losses(path):
    losses = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                losses[int(m.group(1))] = float(m.group(2))
    return losses


def compare(ref, other, from_iter=0):
    common = sorted(i for i in ref.keys() & other.keys() if i >= from_iter)
    if not common:
        return None
    diffs = [other[i] - ref[i] for i in common]
    rel = [abs(d) / abs(ref[i]) for d, i in zip(diffs, common)]
    return {"n": len(common), "first": common[0], "last": common[-1], "max_abs": max(map(abs, diffs)),
            "max_rel": max(rel), "mean_diff": statistics.fmean(diffs),
            "ref_last": ref[common[-1]], "other_last": other[common[-1]]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reference")
    p.add_argument("others", nargs="+")
    p.add_argument("--from-iter", type=int, default=0)
    a = p.parse_args()
    ref = read_losses(a.reference)
    if not ref:
        raise SystemExit(f"error: no 'lm loss' log lines in {a.reference}")
    print(f"reference {a.reference}: {len(ref)} iterations")
    for path in a.others:
        r = compare(ref, read_losses(path), a.from_iter)
        if r is None:
            print(f"{path}: no iterations in common with the reference")
            continue
        print(f"{path}: iterations {r['first']}-{r['last']} ({r['n']}) | max abs diff {r['max_abs']:.4f} | "
              f"max rel diff {r['max_rel']:.2%} | mean diff {r['mean_diff']:+.4f} | last loss "
              f"{r['other_last']:.4f} vs {r['ref_last']:.4f}")


if __name__ == "__main__":
    main()
