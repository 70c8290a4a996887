"""Per-function tottime difference, Trainer.step minus the hand loop, from two raw cProfile dumps (60 steps each)."""
import pstats, sys
def load(f):
    return {f"{file.split('site-packages/')[-1].split('.snap/')[-1]}:{line}({fn})": (nc, tt, ct)
            for (file, line, fn), (cc, nc, tt, ct, callers) in pstats.Stats(f).stats.items()}
h, t = load(sys.argv[1]), load(sys.argv[2])
print("tottime per step: hand %.0f us, Trainer.step %.0f us" % (sum(v[1] for v in h.values()) / 60 * 1e6, sum(v[1] for v in t.values()) / 60 * 1e6))
rows = sorted((((t.get(k, (0, 0, 0))[1] - h.get(k, (0, 0, 0))[1]) / 60 * 1e6, k, h.get(k, (0,))[0], t.get(k, (0,))[0]) for k in set(h) | set(t)), reverse=True)
print("  +us/step  calls/60 steps (hand -> Trainer.step)  function")
for d, k, a, b in rows[:30]:
    print(f"{d:9.1f}  {a:6d} -> {b:6d}  {k[-100:]}")
