#!/usr/bin/env python3
"""Hostile-user probe of ``Trainer(graph_optimizer_step=True)`` (precisionloop/captured.py) against its eager twin.

Every scenario builds two Trainers from identical seeds -- the "eager" twin (graph_optimizer_step=False) and
the "graph" twin (graph_optimizer_step=True) -- runs the same operations on both, one operation at a time,
eager first, and after every operation compares, bit for bit (NaN-aware torch.equal, plus shape, dtype and
strides): weights, buffers and gradients, every entry of optimizer.state_dict() (state tensors and every
param_group setting), the scheduler's state_dict, global_step, micro, consecutive_skips, trainer.stats
(settled, or the raw unsettled counters where a scenario says so), loop_state, the RNG states, and the
operation's return value (StepResult loss/skipped/stepped, fit records). Each twin runs with its own RNG
state (swapped in around each of its operations) and its own recorded warnings.

Outcomes: PASS; FAIL (a graph-vs-eager difference, a graph-only warning other than the documented give-up
warning, an unexpected give-up, a comparison that was vacuous because the graph hardly replayed, or an oracle
check of the library's own behaviour); ERROR (the probe's own code raised: see the traceback); SKIP.
An exception raised by an operation is a finding unless the other twin raises the same exception type.

Run on the GPU machine (torch 2.11+, one CUDA device):
    cd <repo> && PYTHONPATH=. python3 .bench/probe_graph.py --out $OUT/probe.json
CPU smoke test (both twins eager, device cpu; CUDA-only scenarios SKIP):
    cd <repo> && PYTHONPATH=. python3 .bench/probe_graph.py --smoke-cpu --out /tmp/probe_cpu.json
Other flags: --only a,b (names or substrings)  --list  --budget SECONDS (default 190: scenarios not started
by then SKIP; the compile scenario needs --compile-budget (90) seconds left)  --no-compile
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch: deterministic cuBLAS

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.optim.optimizer as optim_module
from torch import nn

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

torch.backends.cudnn.deterministic = True
torch.use_deterministic_algorithms(True, warn_only=True)

import precisionloop  # noqa: E402
from precisionloop import Trainer  # noqa: E402
from precisionloop import _compat as PL_COMPAT  # noqa: E402
from precisionloop.engine import StepResult  # noqa: E402

GIVE_UP = "graph_optimizer_step: the optimizer step runs eagerly from now on"
NAN, INF = float("nan"), float("inf")
D_IN, HID, NCLS, BS = 16, 32, 4, 8
PRECS = ("bf16", "fp32", "tf32")
THIS_FILE = os.path.abspath(__file__)


class Cfg:
    smoke = False
    device = "cuda"
    graph = True  # graph_optimizer_step of the graph twin (False in the CPU smoke test)
    tmp: Path = Path(tempfile.gettempdir())
    t_start = 0.0
    budget = 200.0
    compile_budget = 60.0
    no_compile = False
    sim = False  # --sim-graph-cpu: the graph twin runs CapturedStep with a simulated (eager-replaying) graph on the CPU


CFG = Cfg()


def on_cuda() -> bool:
    return CFG.device.startswith("cuda")


class InjectedInterrupt(KeyboardInterrupt):
    """A Ctrl-C the probe raises on purpose (told apart from a real one)."""


class Finding(Exception):
    """A graph-vs-eager difference: the scenario FAILs and stops."""


class Skip(Exception):
    pass


class ProbeBug(Exception):
    """The scenario did not go as the probe meant (an injection that never fired...): ERROR."""


# ----------------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------------


def fnum(x):
    return "nan" if isinstance(x, float) and x != x else x


def _volatile(key) -> bool:
    return isinstance(key, str) and ("time" in key or "per_s" in key)


def view(v):
    """A comparable form of an operation's return value (reads StepResults: a host sync)."""
    if isinstance(v, StepResult):
        return {"due": v.due, "loss": fnum(v.loss), "skipped": v.skipped, "stepped": v.stepped, "scale": fnum(v.scale)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return view(dataclasses.asdict(v))
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return fnum(v)
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, Mapping):
        return {k: view(x) for k, x in v.items() if not _volatile(k)}
    if isinstance(v, (list, tuple)):
        return [view(x) for x in v]
    if isinstance(v, os.PathLike):
        return "<path>"
    return f"<{type(v).__name__}>"


def tensor_diff(x: torch.Tensor, y: torch.Tensor, path: str) -> str | None:
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        return f"{path}: {tuple(x.shape)}/{x.dtype}/{x.device} vs {tuple(y.shape)}/{y.dtype}/{y.device}"
    if x.layout != y.layout:
        return f"{path}: layout {x.layout} vs {y.layout}"
    if x.is_sparse:
        x, y = x.coalesce().to_dense(), y.coalesce().to_dense()
    elif x.layout == torch.strided and x.stride() != y.stride():
        return f"{path}: strides {x.stride()} vs {y.stride()}"
    if x.is_floating_point() or x.is_complex():
        xn, yn = torch.isnan(x), torch.isnan(y)
        if not torch.equal(xn, yn):
            return f"{path}: NaN at different places ({int(xn.sum())} vs {int(yn.sum())} NaNs)"
        if torch.equal(x.masked_fill(xn, 0), y.masked_fill(yn, 0)):
            return None
        d = (x.double() - y.double()).abs().nan_to_num(nan=0.0, posinf=float("inf"))
        n = int((x.masked_fill(xn, 0) != y.masked_fill(yn, 0)).sum())
        return f"{path}: {n}/{x.numel()} elements differ, max |diff| {d.max().item():.3g}"
    return None if torch.equal(x, y) else f"{path}: values differ"


def diff(x, y, path: str = "") -> str | None:
    """The first difference between two nested structures, or None."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return f"{path}: {type(x).__name__} vs {type(y).__name__}"
        return tensor_diff(x, y, path)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        kx, ky = list(x.keys()), list(y.keys())
        if set(map(repr, kx)) != set(map(repr, ky)):
            return f"{path}: keys {sorted(map(repr, set(kx) - set(ky)))} only in eager, {sorted(map(repr, set(ky) - set(kx)))} only in graph"
        for k in kx:
            r = diff(x[k], y[k], f"{path}.{k}")
            if r:
                return r
        return None
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if type(x) is not type(y) or len(x) != len(y):
            return f"{path}: {type(x).__name__}[{len(x)}] vs {type(y).__name__}[{len(y)}]"
        for i, (a, b) in enumerate(zip(x, y)):
            r = diff(a, b, f"{path}[{i}]")
            if r:
                return r
        return None
    if isinstance(x, float) and isinstance(y, float):
        if x != x and y != y:
            return None
        return None if x == y else f"{path}: {x!r} vs {y!r}"
    if type(x) is not type(y):
        return f"{path}: {type(x).__name__} {x!r} vs {type(y).__name__} {y!r}"
    if callable(x):
        return None
    if np is not None and isinstance(x, np.ndarray):
        return None if np.array_equal(x, y) else f"{path}: arrays differ"
    try:
        same = bool(x == y)
    except Exception:  # noqa: BLE001
        same = repr(x) == repr(y)
    return None if same else f"{path}: {x!r} vs {y!r}"


def fmt_exc(e: BaseException | None) -> str:
    if e is None:
        return "nothing"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}({msg[:160]})"


def tb_tail(e: BaseException, lines: int = 12) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-lines:])[-3000:]


# ----------------------------------------------------------------------------------------------------------------
# RNG per twin
# ----------------------------------------------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed)


def get_rng():
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if on_cuda() else None, random.getstate(),
            np.random.get_state() if np is not None else None)


def set_rng(s) -> None:
    torch.set_rng_state(s[0])
    if s[1] is not None:
        torch.cuda.set_rng_state(s[1])
    random.setstate(s[2])
    if np is not None and s[3] is not None:
        np.random.set_state(s[3])


# ----------------------------------------------------------------------------------------------------------------
# Twins
# ----------------------------------------------------------------------------------------------------------------


class Twin:
    def __init__(self, label: str, is_graph: bool):
        self.label, self.is_graph = label, is_graph
        self.trainer: Trainer | None = None
        self.sched = None
        self.extra: dict = {}
        self.captured = None  # the CapturedStep object (kept even after the engine drops it)
        self.rng = None
        self.new: list = []  # warnings of the current operation
        self.warnings: list = []  # all of them: (op, category, message, filename)

    @property
    def model(self):
        return self.trainer.model

    @property
    def opt(self):
        return self.trainer.optimizer

    @contextlib.contextmanager
    def active(self, label: str):
        if self.rng is not None:
            set_rng(self.rng)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                self.rng = get_rng()
                for w in rec:
                    entry = (label, w.category.__name__, str(w.message), f"{w.filename}:{w.lineno}")
                    self.new.append(entry)
                    self.warnings.append(entry)


class Pair:
    """Two twins built alike; ``op`` runs one operation on both and compares."""

    def __init__(self, ctx, build, name: str = "main", *, oracle: bool = False, seed: int = 0,
                 min_replays: int | None = None, allow_give_up=None, settle: bool = True):
        self.ctx, self.name, self.oracle, self.settle = ctx, name, oracle, settle
        self.min_replays = ctx.spec["min_replays"] if min_replays is None else min_replays
        self.allow_give_up = ctx.spec["allow_give_up"] if allow_give_up is None else allow_give_up
        self.ctl: dict = {}  # shared by both twins' models and hooks
        self.eager, self.graph = Twin("eager", False), Twin("graph", True)
        self.give_up_warnings = 0
        self.ops = 0
        self.last_exc: tuple = (None, None)  # the last operation's exceptions (eager, graph)
        for twin in (self.eager, self.graph):
            seed_all(seed)
            twin.rng = get_rng()
            with twin.active("build"):
                built = build(twin, CFG.graph and twin.is_graph and not oracle, self.ctl)
            twin.trainer = built.pop("trainer")
            twin.sched = built.pop("sched", twin.trainer.scheduler)
            twin.extra.update(built)
            if CFG.sim and not oracle:
                sim_fuse(twin.trainer)  # what the Trainer does on CUDA, for both twins
                if twin.is_graph:
                    sim_attach(twin.trainer)
            twin.captured = twin.trainer.engine.captured
        self.check_warnings("build")
        ctx.pairs.append(self)

    # -- operations --------------------------------------------------------------------------------------------

    def op(self, label: str, fn, *, expect=None, compare: bool = True, read: bool = True, settle: bool | None = None):
        """Run ``fn(twin)`` on the eager twin, then the graph twin; compare exceptions, results and state."""
        label = f"{self.name}:{label}" if self.name != "main" else label
        outs = []
        for twin in (self.eager, self.graph):
            val = exc = None
            with twin.active(label):
                try:
                    val = fn(twin)
                except InjectedInterrupt as e:
                    exc = e
                except Exception as e:  # noqa: BLE001
                    exc = e
            outs.append((val, exc))
        self.ops += 1
        (ve, ee), (vg, eg) = outs
        self.last_exc = (ee, eg)
        if ee is not None or eg is not None:
            if type(ee) is not type(eg):
                self.ctx.graph_tb = tb_tail(eg) if eg is not None else tb_tail(ee)
                raise Finding(f"[{label}] eager raised {fmt_exc(ee)}, graph raised {fmt_exc(eg)}")
            if str(ee) != str(eg) and not (expect is not None and isinstance(ee, expect)):
                self.ctx.note(f"[{label}] both raised {type(ee).__name__} with different messages: "
                              f"{fmt_exc(ee)} / {fmt_exc(eg)}")
            if expect is None or not isinstance(ee, expect):
                self.ctx.note(f"[{label}] both twins raised {fmt_exc(ee)}")
        elif expect is not None:
            raise ProbeBug(f"[{label}] expected {expect} from the injection, but neither twin raised")
        if compare:
            if read and ee is None:
                d = diff(view(ve), view(vg), "result")
                if d:
                    raise Finding(f"[{label}] return values differ: {d}")
            self.compare(label, self.settle if settle is None else settle)
        self.check_warnings(label)
        return ve, vg

    def step(self, i, batch, *, expect=None, compare=True, read=True, settle=None, keep=False, **ctl):
        """``trainer.step(batch)`` with ``ctl`` overrides (x_scale, grad_mult, raise, branch...) for this step."""
        saved = dict(self.ctl)
        self.ctl.update(ctl)
        tag = ",".join(f"{k}={v}" for k, v in ctl.items())

        def fn(t):
            r = t.trainer.step(batch)
            if keep:
                t.extra.setdefault("results", []).append(r)
            return r
        try:
            return self.op(f"step{i}" + (f"[{tag}]" if tag else ""), fn, expect=expect, compare=compare, read=read,
                           settle=settle)
        finally:
            self.ctl.clear()
            self.ctl.update(saved)

    def steps(self, batches, start=0, plan=None, **kw):
        plan = plan or {}
        for i, b in enumerate(batches, start):
            self.step(i, b, **plan.get(i, {}), **kw)

    def each(self, label, fn, **kw):
        """An action on both twins whose value is not compared (hand edits between steps)."""
        return self.op(label, lambda t: (fn(t), None)[1], **kw)

    # -- checks ------------------------------------------------------------------------------------------------

    def snapshot(self, twin: Twin, label: str, settle: bool) -> dict:
        tr = twin.trainer
        s: dict = {}
        with twin.active(label + ":check"):
            try:
                stats = tr.stats if settle else tr.engine.stats
                s["stats"] = dataclasses.asdict(stats)
            except Exception as e:  # noqa: BLE001  (the skip limit raises here)
                s["stats"] = f"raised {type(e).__name__}"
            s["global_step"] = tr.global_step
            s["micro"] = tr.engine.micro
            s["consecutive_skips"] = tr.engine.consecutive_skips
            s["loop"] = (tr.loop_state.epoch, tr.loop_state.batch_in_epoch)
            s["model"] = dict(tr.model.state_dict())
            s["grads"] = {n: p.grad for n, p in tr.model.named_parameters()}
            s["requires_grad"] = {n: p.requires_grad for n, p in tr.model.named_parameters()}
            s["opt_params"] = [p.detach() for g in tr.optimizer.param_groups for p in g["params"]]
            s["opt"] = tr.optimizer.state_dict()
            s["opt_defaults"] = dict(tr.optimizer.defaults)
            s["sched"] = twin.sched.state_dict() if twin.sched is not None else None
            rng = get_rng()
            s["rng"] = [rng[0], rng[1]]
        return s

    def compare(self, label: str, settle: bool = True) -> None:
        a, b = self.snapshot(self.eager, label, settle), self.snapshot(self.graph, label, settle)
        d = diff(a, b, "state")
        if d:
            raise Finding(f"after [{label}]: {d}")

    def check_warnings(self, label: str) -> None:
        def norm(w):
            return (w[1], re.sub(r"0x[0-9a-fA-F]+", "0x?", w[2]))

        def ignored(w):
            return GIVE_UP in w[2] or "deterministic" in w[2].lower()

        we, wg = self.eager.new, self.graph.new
        self.eager.new, self.graph.new = [], []
        gu = [w for w in wg if GIVE_UP in w[2]]
        self.give_up_warnings += len(gu)
        for w in gu:
            self.ctx.info.setdefault("give_up_warnings", []).append({"op": w[0], "message": w[2], "where": w[3]})
            if not w[3].startswith(THIS_FILE):
                self.ctx.note(f"[{label}] the give-up warning points at {w[3]}, not at the caller's line")
        if any(GIVE_UP in w[2] for w in we):
            self.ctx.fail(f"[{label}] the EAGER twin warned {GIVE_UP!r}")
        ce = collections.Counter(norm(w) for w in we if not ignored(w))
        cg = collections.Counter(norm(w) for w in wg if not ignored(w))
        graph_only, eager_only = cg - ce, ce - cg
        if graph_only:
            self.ctx.fail(f"[{label}] graph-only warning(s): " + "; ".join(f"{c}: {m[:200]}" for c, m in graph_only))
        if eager_only:
            self.ctx.note(f"[{label}] eager-only warning(s) (a warn-once in torch?): "
                          + "; ".join(f"{c}: {m[:160]}" for c, m in eager_only))

    def final(self, label="final") -> None:
        """A settled comparison (books every verdict: counters, scheduler)."""
        self.compare(label, settle=True)

    def post_check(self) -> dict:
        """After the scenario: give-up and replay expectations on the graph twin (real graph runs only)."""
        cap = self.graph.captured
        out = {"pair": self.name, "ops": self.ops, "give_up_warnings": self.give_up_warnings}
        if cap is None:
            return out
        out.update(captures=cap.captures, replays=cap.replays, given_up=cap.given_up)
        if self.oracle or (CFG.smoke and not CFG.sim):
            return out
        allowed = self.allow_give_up
        if cap.given_up is not None:
            if allowed != "*" and not any(s in cap.given_up for s in allowed):
                self.ctx.fail(f"[{self.name}] unexpected give-up: {cap.given_up}")
            else:
                self.ctx.note(f"[{self.name}] graph gave up (allowed here): {cap.given_up}")
            if self.give_up_warnings != 1:
                self.ctx.fail(f"[{self.name}] gave up with {self.give_up_warnings} give-up warnings (documented: one)")
        elif self.give_up_warnings:
            self.ctx.fail(f"[{self.name}] {self.give_up_warnings} give-up warnings but given_up is None")
        if cap.replays < self.min_replays:
            self.ctx.fail(f"[{self.name}] the graph replayed only {cap.replays} times (< {self.min_replays}): "
                          "the comparison was mostly eager against eager")
        return out


class Ctx:
    def __init__(self, spec: dict):
        self.spec = spec
        self.pairs: list[Pair] = []
        self.notes: list[str] = []
        self.soft: list[str] = []
        self.info: dict = {}
        self.graph_tb: str | None = None
        self._cleanups: list = []
        self.tmp = CFG.tmp

    def pair(self, build, name="main", **kw) -> Pair:
        return Pair(self, build, name, **kw)

    def note(self, msg: str) -> None:
        if len(self.notes) < 40:
            self.notes.append(msg)

    def fail(self, msg: str) -> None:
        if len(self.soft) < 40:
            self.soft.append(msg)

    def patch(self, obj, attr, value) -> None:
        had, old = hasattr(obj, attr), getattr(obj, attr, None)
        setattr(obj, attr, value)
        self._cleanups.append(lambda: setattr(obj, attr, old) if had else delattr(obj, attr))

    def cleanup(self, fn) -> None:
        self._cleanups.append(fn)

    def close(self) -> None:
        while self._cleanups:
            with contextlib.suppress(Exception):
                self._cleanups.pop()()


# ----------------------------------------------------------------------------------------------------------------
# Models, data, builders
# ----------------------------------------------------------------------------------------------------------------


class Net(nn.Module):
    """A small MLP whose forward and one weight's gradient the scenario can poison or interrupt via ``ctl``.

    ctl keys: x_scale (multiplies the input: nan/inf poison the loss), grad_mult (multiplies fc2.weight's gradient:
    nan/inf poison one gradient), branch (False: the branch layer gets no gradient), raise ("forward"/"grad_hook").
    """

    def __init__(self, ctl: dict, *, d_in=D_IN, hid=HID, branch=False, dropout=0.0, odd=False):
        super().__init__()
        self.ctl = ctl
        self.fc1, self.fc2, self.head = nn.Linear(d_in, hid), nn.Linear(hid, hid), nn.Linear(hid, NCLS)
        self.branch = nn.Linear(hid, hid) if branch else None
        self.drop = nn.Dropout(dropout) if dropout else None
        self.odd = odd
        if odd:  # an fp64 parameter, a zero-size one, a non-contiguous (transposed) one
            self.scale64 = nn.Parameter(torch.ones(NCLS, dtype=torch.float64))
            self.empty = nn.Parameter(torch.zeros(0))
            self.wt = nn.Parameter(torch.randn(NCLS, hid).t())
        self.fc2.weight.register_hook(self._grad_hook)

    def _grad_hook(self, g):
        if self.ctl.get("raise") == "grad_hook":
            raise InjectedInterrupt("grad hook")
        m = self.ctl.get("grad_mult")
        return g * m if m is not None else g

    def forward(self, x):
        c = self.ctl
        if c.get("raise") == "forward":
            raise InjectedInterrupt("forward")
        if c.get("x_scale") is not None:
            x = x * c["x_scale"]
        h = F.relu(self.fc1(x))
        if self.drop is not None:
            h = self.drop(h)
        h = F.relu(self.fc2(h))
        if self.branch is not None and c.get("branch", True):
            h = h + torch.tanh(self.branch(h))
        out = self.head(h)
        if self.odd:
            h = h + self.empty.sum()
            out = (out + 0.125 * (h @ self.wt)).double() * self.scale64
        return out


class ConvNet(nn.Module):
    def __init__(self, ctl: dict):
        super().__init__()
        self.ctl = ctl
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, NCLS)

    def forward(self, x):
        if self.ctl.get("x_scale") is not None:
            x = x * self.ctl["x_scale"]
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.head(x.mean((2, 3)))  # not AdaptiveAvgPool2d: its CUDA backward is nondeterministic


class EmbNet(nn.Module):
    def __init__(self, ctl: dict):
        super().__init__()
        self.ctl = ctl
        self.emb, self.head = nn.Embedding(20, 16, sparse=True), nn.Linear(16, NCLS)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def make_batches(n, *, seed=1, bs=BS, d_in=D_IN, nan_at=(), device=None, image=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if image:
            x = torch.randn(bs, 3, image, image, generator=g)
        else:
            x = torch.randn(bs, d_in, generator=g)
        y = torch.randint(0, NCLS, (bs,), generator=g)
        if i in nan_at:
            x.view(-1)[0] = NAN  # one sample's loss is NaN: some gradients are NaN
        dev = CFG.device if device is None else device
        out.append((x.to(dev), y.to(dev)))
    return out


def make_opt(cls, kw: dict, fused: bool, split: bool = True):
    """An optimizer factory: weights in group 0, biases (and other <=1-D params) in group 1 with no decay, 2x LR."""
    def f(model):
        params = [p for p in model.parameters() if p.requires_grad]
        extra = {"fused": True} if fused else {}
        if not split:
            return cls(params, **kw, **extra)
        big, small = [p for p in params if p.dim() > 1], [p for p in params if p.dim() <= 1]
        groups = [{"params": big}]
        if small:
            groups.append({"params": small, "weight_decay": 0.0, "lr": kw["lr"] * 2})
        return cls(groups, **kw, **extra)
    return f


def std(model_fn, opt_fn, precision="bf16", sched_fn=None, **kw):
    def build(twin, graph, ctl):
        model = model_fn(ctl)
        opt = opt_fn(model)
        sched = sched_fn(opt, ctl) if sched_fn else None
        tr = Trainer(model, opt, precision, device=CFG.device, scheduler=sched, graph_optimizer_step=graph, **kw)
        return dict(trainer=tr, sched=sched)
    return build


SGD, Adam, AdamW = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
SGD_MOM = dict(lr=2**-5, momentum=0.875)
SGD_NEST = dict(lr=2**-5, momentum=0.9, nesterov=True, weight_decay=2**-10)
ADAM = dict(lr=2**-7, weight_decay=2**-8)
ADAMW = dict(lr=2**-7, weight_decay=2**-5)


def lam(fn):
    """A LambdaLR factory for ``std``."""
    return lambda opt, ctl: torch.optim.lr_scheduler.LambdaLR(opt, fn)


# ----------------------------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------------------------

SCENARIOS: list[dict] = []


def scenario(name, *, desc, cuda_only=False, min_replays=4, allow_give_up=(), needs=None, sim_ok=False):
    """sim_ok: a CUDA-only scenario whose code can still be exercised with --sim-graph-cpu."""
    def deco(fn):
        SCENARIOS.append(dict(name=name, fn=fn, desc=desc, cuda_only=cuda_only, min_replays=min_replays,
                              allow_give_up=allow_give_up, needs=needs, sim_ok=sim_ok))
        return fn
    return deco


# --sim-graph-cpu: a self-test of this probe on a machine without CUDA. The graph twin gets a CapturedStep whose
# "graph" replays the captured body eagerly (so it never goes stale, unlike a real graph): this exercises the
# probe's code and CapturedStep's match/recapture/give-up/LR-refill logic, not CUDA graph semantics.


class SimGraph:
    def __init__(self, cs, params):
        self.cs, self.params = cs, list(params)

    def replay(self):
        cs, opt = self.cs, self.cs.optimizer
        saved_grads, saved_lrs = [p.grad for p in self.params], [g["lr"] for g in opt.param_groups]
        try:
            for p, st in zip(self.params, cs._static):
                p.grad = st
            for g, (lr, _) in zip(opt.param_groups, cs._lrs):
                g["lr"] = float(lr)
            _sim_body(cs, opt)
        finally:
            for g, lr in zip(opt.param_groups, saved_lrs):
                g["lr"] = lr
            for p, gr in zip(self.params, saved_grads):
                p.grad = gr


def _sim_body(cs, opt):
    cs._found.zero_()
    PL_COMPAT.non_finite_check_(cs._static, cs._found, cs._ones)
    PL_COMPAT.step_with_verdict(opt, cs._found)


def _sim_record(self, params, ones):
    """CapturedStep._record without CUDA: the body runs twice on NaN buffers (warm-up and "capture": both skip)."""
    opt = self.optimizer
    saved_grads, saved_lrs = [p.grad for p in params], [g["lr"] for g in opt.param_groups]
    counts = [(t, t.clone()) for p in params for k, t in (opt.state.get(p) or {}).items()
              if k == "step" and isinstance(t, torch.Tensor)]
    try:
        for p, st in zip(params, self._static):
            p.grad = st
        for g, (lr, _) in zip(opt.param_groups, self._lrs):
            g["lr"] = float(lr)
        for _ in range(2):
            for st in self._static:
                st.fill_(NAN)
            _sim_body(self, opt)
        return SimGraph(self, params)
    except BaseException:
        for c, saved in counts:
            c.copy_(saved)
        raise
    finally:
        for g, lr in zip(opt.param_groups, saved_lrs):
            g["lr"] = lr
        for p, gr in zip(params, saved_grads):
            p.grad = gr


def sim_fuse(trainer):
    from precisionloop.guard import fusable, fuse_default_optimizer
    if fusable(trainer.optimizer, trainer.model):
        fuse_default_optimizer(trainer.optimizer, trainer.model, device_types=("cpu",))


def sim_attach(trainer):
    from precisionloop.captured import CapturedStep
    CapturedStep._record = _sim_record
    engine = trainer.engine
    engine.graph_optimizer_step = True
    engine.captured = CapturedStep(engine.optimizer)


# 1. Refusals --------------------------------------------------------------------------------------------------


@scenario("refusals_leave_state_untouched", min_replays=0,
          desc="graph_optimizer_step=True setups that must be refused (fp16, bf16 params, clipping, unfused/foreach/"
               "capturable/Adagrad/sparse-embedding optimizers, autotune, non-bool flag) raise ValueError before any "
               "change to the model (values, device) or optimizer (groups, state, fused attrs); the same objects "
               "then train in an eager Trainer")
def s_refusals(ctx):
    cuda = on_cuda()

    def mlp():
        torch.manual_seed(0)
        return Net({})

    cases = [
        ("fp16", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5, fused=True), dict(precision="fp16")),
         r"not capturable.*'bf16' or 'fp32'" if cuda else "CUDA device"),
        ("fp16-dtype", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5, fused=True), dict(precision=torch.float16)),
         r"not capturable" if cuda else "CUDA device"),
        ("bf16-params", lambda: (m := mlp().bfloat16(), SGD(m.parameters(), lr=2**-5, fused=True), dict()),
         "not fp32"),
        ("clipping", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5, fused=True), dict(max_grad_norm=1.0)),
         "max_grad_norm" if cuda else "CUDA device"),
        ("sgd-unfused-no-fuse", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5), dict(fuse_optimizer=False)),
         r"fused=\[None" if cuda else "CUDA device"),
        ("sgd-foreach", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5, foreach=True), dict()),
         r"fused=\[None" if cuda else "CUDA device"),
        ("sgd-fused-false", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5, fused=False), dict()),
         r"fused=\[False" if cuda else "CUDA device"),
        ("adam-capturable", lambda: (m := mlp(), Adam(m.parameters(), lr=2**-7, capturable=True), dict()),
         "fused" if cuda else "CUDA device"),
        ("adagrad", lambda: (m := mlp(), torch.optim.Adagrad(m.parameters(), lr=2**-5), dict()),
         "Adagrad" if cuda else "CUDA device"),
        ("sparse-embedding", lambda: (m := EmbNet({}), SGD(m.parameters(), lr=2**-5), dict()),
         "fused" if cuda else "CUDA device"),
        ("autotune", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5), dict(precision="auto", autotune=True)),
         "autotune" if cuda else "CUDA device"),
        ("flag-str", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5), dict(graph_optimizer_step="yes")),
         "must be True or False"),
        ("flag-int", lambda: (m := mlp(), SGD(m.parameters(), lr=2**-5), dict(graph_optimizer_step=1)),
         "must be True or False"),
    ]
    results = {}
    for name, make, pattern in cases:
        model, opt, kw = make()
        kw = {"precision": "bf16", "device": CFG.device, "graph_optimizer_step": True, **kw}
        before = {k: v.clone() for k, v in model.state_dict().items()}
        devices = {n: p.device for n, p in model.named_parameters()}
        groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        state_before = copy.deepcopy(opt.state_dict()["state"])  # Adagrad makes its state in its constructor
        attrs = {a: getattr(opt, a, None) for a in ("_step_supports_amp_scaling", "_need_device_dtype_check_for_fused")}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                Trainer(model, opt, **kw)
                err = None
            except ValueError as e:
                err = e
            except Exception as e:  # noqa: BLE001
                err = e
        results[name] = fmt_exc(err)
        if not isinstance(err, ValueError):
            ctx.fail(f"{name}: expected a ValueError, got {fmt_exc(err)}")
            continue
        if not re.search(pattern, str(err)):
            ctx.fail(f"{name}: message does not match {pattern!r}: {str(err)[:200]}")
        if "graph_optimizer_step" not in str(err) and name not in ("bf16-params",):
            ctx.note(f"{name}: the message does not name graph_optimizer_step: {str(err)[:160]}")
        d = diff(before, dict(model.state_dict()), "model")
        if d:
            ctx.fail(f"{name}: the refused Trainer changed the model: {d}")
        if devices != {n: p.device for n, p in model.named_parameters()}:
            ctx.fail(f"{name}: the refused Trainer moved the model")
        d = diff(groups, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], "groups")
        if d:
            ctx.fail(f"{name}: the refused Trainer changed the optimizer's groups: {d}")
        d = diff(state_before, opt.state_dict()["state"], "optimizer.state")
        if d:
            ctx.fail(f"{name}: the refused Trainer changed the optimizer state: {d}")
        if attrs != {a: getattr(opt, a, None) for a in attrs}:
            ctx.fail(f"{name}: the refused Trainer changed optimizer attributes {attrs}")
        if name in ("fp16", "sgd-unfused-no-fuse", "clipping"):  # the same objects still train eagerly
            kw2 = {k: v for k, v in kw.items() if k != "graph_optimizer_step"}
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                tr = Trainer(model, opt, **kw2)
                r = tr.step(make_batches(1)[0])
                if not r.stepped:
                    ctx.fail(f"{name}: the eager Trainer built after the refusal did not step")
    ctx.info["refusals"] = results


# 2. Every optimizer configuration, fused=True and built with defaults ---------------------------------------------

OPTS = {
    "sgd_plain": (SGD, dict(lr=2**-4)),
    "sgd_momentum_dampening": (SGD, dict(lr=2**-5, momentum=0.875, dampening=0.5)),
    "sgd_nesterov_wd": (SGD, SGD_NEST),
    "sgd_maximize_wd": (SGD, dict(lr=2**-7, momentum=0.5, weight_decay=2**-8, maximize=True)),
    "adam_amsgrad_wd": (Adam, dict(lr=2**-7, amsgrad=True, weight_decay=2**-7)),
    "adam_maximize": (Adam, dict(lr=2**-8, maximize=True, betas=(0.75, 0.9921875))),
    "adamw": (AdamW, ADAMW),
    "adamw_amsgrad_eps": (AdamW, dict(lr=2**-7, amsgrad=True, eps=2**-20)),
}
# NaN loss at the very first step (before any state), a NaN in one gradient (fc2.weight), inf inputs twice in a row
# (the capture step for SGD with momentum is step 2 or 3), an inf gradient later.
OPT_PLAN = {0: dict(x_scale=NAN), 2: dict(grad_mult=NAN), 5: dict(x_scale=INF), 6: dict(x_scale=INF),
            9: dict(grad_mult=INF)}


def _opt_scenario(cls, kw, fused, precision):
    def run(ctx):
        pair = ctx.pair(std(lambda c: Net(c), make_opt(cls, kw, fused), precision))
        pair.steps(make_batches(14, seed=3), plan=OPT_PLAN)
        pair.final()
        ctx.info["precision"] = precision
    return run


for _i, (_key, (_cls, _kw)) in enumerate(OPTS.items()):
    for _fused in (True, False):
        _prec = PRECS[_i % 3]
        scenario(f"opt_{_key}_{'fused' if _fused else 'defaults'}", min_replays=6,
                 desc=f"{_cls.__name__}({', '.join(f'{k}={v}' for k, v in _kw.items())}) "
                      f"{'fused=True' if _fused else 'built with defaults (the Trainer fuses it)'}, two groups "
                      f"(no decay / 2x LR for biases), {_prec}; NaN loss at step 0, NaN grad at 2, inf inputs at 5-6, "
                      f"inf grad at 9; 14 steps")(_opt_scenario(_cls, _kw, _fused, _prec))


# 3. Schedulers and hyperparameters -----------------------------------------------------------------------------


@scenario("sched_steplr_and_per_group_lambdalr", min_replays=10,
          desc="StepLR(step 3, gamma 0.5) on nesterov SGD and LambdaLR with per-group power-of-two lambdas on Adam; "
               "NaN steps in between (the scheduler steps only after real steps); 18 steps each")
def s_sched(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_NEST, False), "bf16",
                     sched_fn=lambda o, c: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)), "steplr")
    b = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "fp32",
                     sched_fn=lambda o, c: torch.optim.lr_scheduler.LambdaLR(
                         o, [lambda s: 2.0 ** -(s % 3), lambda s: 2.0 ** -(s % 4)])), "lambdalr")
    data = make_batches(18, seed=4)
    plan = {4: dict(x_scale=NAN), 9: dict(grad_mult=NAN), 10: dict(x_scale=NAN)}
    for i, batch in enumerate(data):
        a.step(i, batch, **plan.get(i, {}))
        b.step(i, batch, **plan.get(i, {}))
    a.final()
    b.final()


@scenario("momentum_and_betas_by_hand_every_step", min_replays=2, allow_give_up=("changed 3 times",),
          desc="OneCycleLR-like: group['momentum'] (SGD) and group['betas'] (AdamW) set by hand before every step, "
               "LR too (powers of two): the documented give-up after 3 quick recaptures, results still bit-exact")
def s_momentum_by_hand(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "bf16"), "sgd-momentum")
    b = ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, False), "bf16"), "adamw-betas")
    data = make_batches(12, seed=5)
    moms = [0.96875, 0.9375, 0.875, 0.75, 0.875, 0.9375, 0.96875, 0.875, 0.75, 0.5, 0.75, 0.875]
    for i, batch in enumerate(data):
        def set_mom(t, i=i):
            for g in t.opt.param_groups:
                g["momentum"], g["lr"] = moms[i], 2.0 ** -(4 + i % 3)

        def set_betas(t, i=i):
            for g in t.opt.param_groups:
                g["betas"] = (moms[i], 0.9921875 if i % 2 else 0.984375)
        a.each(f"momentum={moms[i]}", set_mom, compare=False)
        a.step(i, batch, **({"x_scale": NAN} if i == 7 else {}))
        b.each(f"betas[0]={moms[i]}", set_betas, compare=False)
        b.step(i, batch, **({"x_scale": NAN} if i == 7 else {}))
    a.final()
    b.final()


@scenario("settings_changed_twice_midrun", min_replays=12,
          desc="weight_decay changed at step 5 and betas at step 11 (AdamW), dampening/nesterov-compatible momentum "
               "change for SGD: two recaptures, no give-up, exact; 20 steps")
def s_settings_midrun(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, False), "bf16"), "adamw")
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "tf32"), "sgd")
    data = make_batches(20, seed=6)
    for i, batch in enumerate(data):
        if i == 5:
            a.each("weight_decay=2**-3", lambda t: [g.__setitem__("weight_decay", 2**-3) for g in t.opt.param_groups[:1]])
            b.each("dampening=0.25", lambda t: [g.__setitem__("dampening", 0.25) for g in t.opt.param_groups])
        if i == 11:
            a.each("betas=(0.75,0.96875)", lambda t: [g.__setitem__("betas", (0.75, 0.96875)) for g in t.opt.param_groups])
            b.each("weight_decay=2**-6", lambda t: [g.__setitem__("weight_decay", 2**-6) for g in t.opt.param_groups])
        a.step(i, batch, **({"x_scale": NAN} if i in (6, 12) else {}))
        b.step(i, batch, **({"x_scale": NAN} if i in (6, 12) else {}))
    a.final()
    b.final()


@scenario("betas_list_mutated_in_place", min_replays=12,
          desc="Adam groups whose betas is a list (accepted by torch), mutated in place mid-run (betas[0]=..., "
               "betas[1]=...): the capture's copy of the settings must notice; 18 steps")
def s_betas_list(ctx):
    def opt_fn(model):
        ps = list(model.parameters())
        return Adam([{"params": ps[:3], "betas": [0.875, 0.984375]}, {"params": ps[3:], "betas": [0.75, 0.9921875]}],
                    lr=2**-7)
    pair = ctx.pair(std(lambda c: Net(c), opt_fn, "bf16"))
    for i, batch in enumerate(make_batches(18, seed=7)):
        if i == 6:
            pair.each("betas[0] in place", lambda t: t.opt.param_groups[0]["betas"].__setitem__(0, 0.5))
        if i == 12:
            pair.each("betas[1] in place", lambda t: t.opt.param_groups[1]["betas"].__setitem__(1, 0.96875))
        pair.step(i, batch, **({"x_scale": NAN} if i == 13 else {}))
    pair.final()


def _tensor_betas(ctx, device):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, dict(lr=2**-7), False, split=False), "bf16"))
    data = make_batches(16, seed=8)
    for i, batch in enumerate(data):
        if i == 3:
            pair.each("betas=(tensor(0.875), tensor(0.9921875))", lambda t: t.opt.param_groups[0].__setitem__(
                "betas", (torch.tensor(0.875, device=device), torch.tensor(0.9921875, device=device))))
        if i == 9:
            pair.each("betas[0].fill_(0.5) in place", lambda t: t.opt.param_groups[0]["betas"][0].fill_(0.5))
        if i == 12:
            pair.each("betas[1].fill_(0.96875) in place", lambda t: t.opt.param_groups[0]["betas"][1].fill_(0.96875))
        pair.step(i, batch)
    pair.final()


@scenario("adam_tensor_betas_cpu_filled_in_place", min_replays=4, allow_give_up=("capture failed",),
          desc="HYPOTHESIS: Adam betas set to 0-dim CPU tensors, later changed with fill_ in place; settings are "
               "compared by identity, so a graph that baked the old beta keeps stepping with it")
def s_tensor_betas_cpu(ctx):
    _tensor_betas(ctx, "cpu")


@scenario("adam_tensor_betas_cuda_filled_in_place", cuda_only=True, min_replays=0, allow_give_up=("capture failed",),
          desc="the same with 0-dim CUDA tensors (torch reads them with .item(): expected 'capture failed' give-up)")
def s_tensor_betas_cuda(ctx):
    _tensor_betas(ctx, CFG.device)


@scenario("lr_oddities", min_replays=6,
          desc="LR set by hand to 0.0, int 1, numpy float64/float32, bool-free powers of two, on SGD momentum and "
               "Adam: the graph's LR tensor refill must track each")
def s_lr_odd(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False, split=False), "fp32"), "sgd")
    b = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False, split=False), "fp32"), "adam")
    lrs = {3: 0.0, 4: 1, 5: 2**-6, 7: 2**-5, 9: 2**-8}
    if np is not None:
        lrs.update({6: np.float64(2**-6), 8: np.float32(2**-7)})
    for i, batch in enumerate(make_batches(12, seed=9)):
        if i in lrs:
            for p in (a, b):
                p.each(f"lr={lrs[i]!r}", lambda t, v=lrs[i]: t.opt.param_groups[0].__setitem__("lr", v), compare=False)
        a.step(i, batch)
        b.step(i, batch)
    a.final()
    b.final()


# 4. Parameters and groups changing -----------------------------------------------------------------------------


@scenario("add_param_group_midrun", min_replays=6,
          desc="a branch frozen (not in the optimizer) is unfrozen at step 5 and added with optimizer.add_param_group "
               "(own lr/wd), SGD momentum (defaults, fused by the Trainer) and AdamW; NaN right after; 14 steps")
def s_add_group(ctx):
    def model_fn(c):
        m = Net(c, branch=True)
        m.branch.requires_grad_(False)
        return m

    def opt_of(cls, kw):
        return lambda m: cls([p for p in m.parameters() if p.requires_grad], **kw)
    a = ctx.pair(std(model_fn, opt_of(SGD, SGD_MOM), "bf16"), "sgd")
    b = ctx.pair(std(model_fn, opt_of(AdamW, ADAMW), "bf16"), "adamw")

    def add(t):
        t.model.branch.requires_grad_(True)
        t.opt.add_param_group({"params": list(t.model.branch.parameters()), "lr": 2**-6, "weight_decay": 0.0})
    for i, batch in enumerate(make_batches(14, seed=10)):
        if i == 5:
            a.each("add_param_group", add)
            b.each("add_param_group", add)
        plan = {6: dict(x_scale=NAN)}.get(i, {})
        a.step(i, batch, **plan)
        b.step(i, batch, **plan)
    a.final()
    b.final()


@scenario("freeze_unfreeze_midrun", min_replays=6,
          desc="fc2 frozen with requires_grad_(False) at step 4 and unfrozen at step 8 (Adam and SGD nesterov): "
               "the eager step leaves frozen params alone, so must the graph; 14 steps")
def s_freeze(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"), "adam")
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_NEST, False), "bf16"), "sgd")
    for i, batch in enumerate(make_batches(14, seed=11)):
        for p in (a, b):
            if i == 4:
                p.each("freeze fc2", lambda t: t.model.fc2.requires_grad_(False))
            if i == 8:
                p.each("unfreeze fc2", lambda t: t.model.fc2.requires_grad_(True))
            p.step(i, batch, **({"x_scale": NAN} if i == 9 else {}))
    a.final()
    b.final()


@scenario("conditional_branch_grad_none", min_replays=2, allow_give_up=("changed 3 times",),
          desc="a branch used on some steps only (grad None on the others), Adam and SGD momentum (branch used at "
               "step 0): recaptures, likely the documented give-up; exact throughout; 16 steps")
def s_branch(ctx):
    a = ctx.pair(std(lambda c: Net(c, branch=True), make_opt(Adam, ADAM, False), "bf16"), "adam")
    b = ctx.pair(std(lambda c: Net(c, branch=True), make_opt(SGD, SGD_MOM, False), "bf16"), "sgd")
    used = [True, True, False, True, True, True, False, False, True, True, False, True, True, True, True, False]
    for i, batch in enumerate(make_batches(16, seed=12)):
        for p in (a, b):
            p.step(i, batch, branch=used[i], **({"x_scale": NAN} if i == 9 else {}))
    a.final()
    b.final()


@scenario("sgd_param_first_grad_late", min_replays=0, allow_give_up="*",
          desc="SGD momentum built with defaults; a branch gets its first gradient only at step 3 (grad None before). "
               "Twins must agree; also records whether the Trainer's auto-fused SGD raises where the unfused one "
               "(fuse_optimizer=False) trains")
def s_late_param(ctx):
    opt_fn = make_opt(SGD, SGD_MOM, False, split=False)
    pair = ctx.pair(std(lambda c: Net(c, branch=True), opt_fn, "bf16"))
    ref = ctx.pair(std(lambda c: Net(c, branch=True), opt_fn, "bf16", fuse_optimizer=False), "unfused-ref",
                   oracle=True)
    data = make_batches(8, seed=13)
    raised = {}
    for i, batch in enumerate(data):
        for p in (pair, ref):
            p.step(i, batch, branch=i >= 3)
            if p.last_exc[0] is not None:
                raised.setdefault(p.name, f"step{i}: {fmt_exc(p.last_exc[0])}")
    ctx.info["first_raise_step"] = raised
    if "main" in raised and "unfused-ref" not in raised:
        ctx.note("LIBRARY (eager path too): the Trainer's auto-fused SGD raises when a parameter gets its first "
                 "gradient after others have momentum buffers (torch's fused SGD takes no mix of None and buffers), "
                 "where the same optimizer unfused (fuse_optimizer=False) trains")


# 5. State: save/load, by-hand edits ----------------------------------------------------------------------------


def _save_load_pair(ctx, name, opt_cls, kw, sched_fn=None):
    pair = ctx.pair(std(lambda c: Net(c, dropout=0.125), make_opt(opt_cls, kw, False), "bf16", sched_fn=sched_fn),
                    name)
    data = make_batches(16, seed=14)
    path = {t.label: ctx.tmp / f"{ctx.spec['name']}_{name}_{t.label}.pt" for t in (pair.eager, pair.graph)}
    pair.steps(data[:6], plan={2: dict(x_scale=NAN)})
    pair.each("save", lambda t: t.trainer.save(path[t.label]))
    saved = {k: torch.load(v, weights_only=True) for k, v in path.items()}
    d = diff(saved["eager"], saved["graph"], "checkpoint")
    if d:
        raise Finding(f"[{name}] the twins' checkpoints differ: {d}")
    pair.steps(data[6:10], start=6)
    pair.each("load", lambda t: t.trainer.load(path[t.label]))
    pair.steps(data[6:16], start=6, plan={6: dict(x_scale=NAN)})
    pair.final()
    return pair, path


@scenario("save_load_same_trainer", min_replays=8,
          desc="trainer.save at step 6 (checkpoints of the twins compared), 4 more steps, trainer.load back into the "
               "same trainer, NaN right after the load, steps replayed; SGD nesterov + StepLR and Adam; dropout model")
def s_save_load(ctx):
    _save_load_pair(ctx, "sgd", SGD, SGD_NEST, lambda o, c: torch.optim.lr_scheduler.StepLR(o, 3, 0.5))
    _save_load_pair(ctx, "adam", Adam, ADAM)


@scenario("load_into_fresh_trainer", min_replays=6,
          desc="a checkpoint saved mid-run loaded into freshly built twins (different init seed) that then train on; "
               "the fresh graph twin captures over the loaded state")
def s_load_fresh(ctx):
    _, path = _save_load_pair(ctx, "source", AdamW, ADAMW)
    fresh = ctx.pair(std(lambda c: Net(c, dropout=0.125), make_opt(AdamW, ADAMW, False), "bf16"), "fresh", seed=123)
    fresh.each("load", lambda t: t.trainer.load(path[t.label]))
    fresh.steps(make_batches(10, seed=15), plan={1: dict(x_scale=NAN)})
    fresh.final()


@scenario("load_checkpoint_saved_before_first_step", min_replays=5,
          desc="a checkpoint taken before any step (empty optimizer state) loaded after 6 steps (the state is "
               "cleared in place), then 8 steps; Adam (NaN right after the load) and SGD nesterov (no NaN: see the "
               "oracle scenario)")
def s_load_prestep(ctx):
    for name, cls, kw, nan_after in (("adam", Adam, ADAM, True), ("sgd", SGD, SGD_NEST, False)):
        pair = ctx.pair(std(lambda c: Net(c), make_opt(cls, kw, False), "bf16"), name)
        path = {t.label: ctx.tmp / f"prestep_{name}_{t.label}.pt" for t in (pair.eager, pair.graph)}
        pair.each("save before any step", lambda t: t.trainer.save(path[t.label]))
        data = make_batches(14, seed=16)
        pair.steps(data[:6])
        pair.each("load", lambda t: t.trainer.load(path[t.label]))
        pair.steps(data[6:], start=6, plan={6: dict(x_scale=NAN)} if nan_after else {})
        pair.final()


@scenario("optimizer_from_named_parameters", min_replays=8,
          desc="AdamW built from model.named_parameters() (groups carry a 'param_names' list): steps, save, load "
               "back, steps; NaN right after the load")
def s_named(ctx):
    try:
        pair = ctx.pair(std(lambda c: Net(c), lambda m: AdamW(m.named_parameters(), **ADAMW), "bf16"))
    except TypeError as e:
        raise Skip(f"this torch's optimizers take no named parameters: {fmt_exc(e)}") from None
    data = make_batches(14, seed=44)
    path = {t.label: ctx.tmp / f"named_{t.label}.pt" for t in (pair.eager, pair.graph)}
    pair.steps(data[:6], plan={2: dict(grad_mult=NAN)})
    pair.each("save", lambda t: t.trainer.save(path[t.label]))
    pair.steps(data[6:9], start=6)
    pair.each("load", lambda t: t.trainer.load(path[t.label]))
    pair.steps(data[6:], start=6, plan={6: dict(x_scale=NAN)})
    pair.final()


@scenario("optimizer_load_state_dict_by_hand", min_replays=5, allow_give_up=("changed 3 times",),
          desc="optimizer.load_state_dict(deepcopy(optimizer.state_dict())) by hand between steps: twice (Adam), "
               "and every 2 steps (SGD momentum: the documented give-up)")
def s_opt_load_by_hand(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"), "adam")
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "bf16"), "sgd", min_replays=2)

    def reload(t):
        t.opt.load_state_dict(copy.deepcopy(t.opt.state_dict()))
    for i, batch in enumerate(make_batches(16, seed=17)):
        if i in (4, 9):
            a.each("load_state_dict", reload)
        if i >= 3 and i % 2 == 1:
            b.each("load_state_dict", reload)
        a.step(i, batch, **({"x_scale": NAN} if i == 5 else {}))
        b.step(i, batch, **({"x_scale": NAN} if i == 5 else {}))
    a.final()
    b.final()


@scenario("optimizer_state_cleared_by_hand", min_replays=5,
          desc="optimizer.state.clear() by hand at step 5 (Adam: NaN right after; SGD momentum: finite steps after, "
               "see the oracle scenario for NaN), 12 steps")
def s_state_clear(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"), "adam")
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "bf16"), "sgd")
    for i, batch in enumerate(make_batches(12, seed=18)):
        if i == 5:
            a.each("state.clear()", lambda t: t.opt.state.clear())
            b.each("state.clear()", lambda t: t.opt.state.clear())
        a.step(i, batch, **({"x_scale": NAN} if i == 5 else {}))
        b.step(i, batch)
    a.final()
    b.final()


@scenario("param_data_rehomed", min_replays=6,
          desc="p.data = p.data.clone() for every parameter between steps (same Parameter objects, new storage): "
               "the graph's address check must recapture")
def s_param_rehome(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"))
    data = make_batches(12, seed=19)
    pair.steps(data[:5])

    def rehome(t):
        for p in t.model.parameters():
            p.data = p.data.clone()
    pair.each("p.data = p.data.clone()", rehome)
    pair.steps(data[5:], start=5)
    pair.final()


@scenario("state_data_rehomed", min_replays=4,
          desc="HYPOTHESIS: v.data = v.data.clone() for every optimizer state tensor (Adam) between steps -- the same "
               "tensor objects (identity checks pass) on new storage, as state offloading code does; a graph "
               "holding the old addresses would step freed memory and leave the live state untouched")
def s_state_rehome(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"))
    data = make_batches(12, seed=20)
    pair.steps(data[:5])

    def rehome(t):
        for st in t.opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.data = v.data.clone()
    before = getattr(pair.graph.captured, "captures", None)
    pair.each("state v.data = v.data.clone()", rehome)
    pair.steps(data[5:], start=5)
    pair.final()
    after = getattr(pair.graph.captured, "captures", None)
    ctx.info["captures_before_after_rehome"] = (before, after)
    if before is not None and before == after:
        ctx.note(f"no recapture after the state moved to new storage (captures {before} -> {after})")


@scenario("state_swap_tensors", min_replays=4,
          desc="HYPOTHESIS: torch.utils.swap_tensors(state_tensor, clone) for Adam's state (identity kept, storage "
               "swapped): same hazard as state_data_rehomed")
def s_state_swap(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16"))
    data = make_batches(12, seed=21)
    pair.steps(data[:5])

    def swap(t):
        for st in t.opt.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor):
                    torch.utils.swap_tensors(v, v.detach().clone())
    before = getattr(pair.graph.captured, "captures", None)
    pair.each("swap_tensors(state, clone)", swap)
    pair.steps(data[5:], start=5)
    pair.final()
    after = getattr(pair.graph.captured, "captures", None)
    ctx.info["captures_before_after_swap"] = (before, after)
    if before is not None and before == after:
        ctx.note(f"no recapture after swap_tensors (captures {before} -> {after})")


@scenario("oracle_sgd_momentum_after_state_reset", min_replays=0, allow_give_up="*",
          desc="ORACLE (checks the library, eager path too): fused SGD momentum; optimizer.state.clear() (and, "
               "second case, trainer.load of a pre-step checkpoint) then a NaN step, then finite steps. EACH twin is "
               "compared with the unfused optimizer (fuse_optimizer=False, host-decided skip) within 1e-3 (the twins "
               "are not compared with each other here): uninitialised momentum buffers show as NaN weights")
def s_oracle(ctx):
    fused_opt = make_opt(SGD, dict(lr=2**-5, momentum=0.875), on_cuda() is False, split=False)  # CPU: fused=True
    plain_opt = make_opt(SGD, dict(lr=2**-5, momentum=0.875), False, split=False)
    results = {}
    for case in ("state.clear", "load-prestep"):
        pair = ctx.pair(std(lambda c: Net(c), fused_opt, "fp32"), f"{case}:fused")
        ref = ctx.pair(std(lambda c: Net(c), plain_opt, "fp32", fuse_optimizer=False), f"{case}:unfused", oracle=True)
        fused_groups = pair.eager.opt.param_groups[0].get("fused")
        if not fused_groups:
            raise ProbeBug(f"the 'fused' trainer's SGD is not fused: {fused_groups}")
        data = make_batches(9, seed=22)
        paths = {}
        for p in (pair, ref):
            paths[p.name] = {t.label: ctx.tmp / f"oracle_{case}_{p.name.replace(':', '_')}_{t.label}.pt"
                             for t in (p.eager, p.graph)}
            if case == "load-prestep":
                p.each("save before any step", lambda t, pp=paths[p.name]: t.trainer.save(pp[t.label]))
        for i, batch in enumerate(data):
            for p in (pair, ref):
                if i == 4:
                    if case == "state.clear":
                        p.each("state.clear()", lambda t: t.opt.state.clear())
                    else:
                        p.each("load pre-step checkpoint", lambda t, pp=paths[p.name]: t.trainer.load(pp[t.label]))
                p.step(i, batch, compare=p is ref, **({"x_scale": NAN} if i == 4 else {}))
        want = dict(ref.eager.model.named_parameters())
        for twin in (pair.eager, pair.graph):
            got = dict(twin.model.named_parameters())
            worst, bad = 0.0, []
            for n, w in want.items():
                g = got[n].detach()
                if not torch.isfinite(g).all():
                    bad.append(f"{n} has non-finite values")
                    continue
                err = ((g - w.detach()).abs() / (w.detach().abs() + 1e-3)).max().item()
                worst = max(worst, err)
                if not torch.allclose(g, w.detach(), rtol=1e-3, atol=1e-5):
                    bad.append(f"{n} off by {err:.3g} (rel)")
            bufs = [st.get("momentum_buffer") for st in twin.opt.state.values()]
            results[f"{case}:{twin.label}"] = {
                "worst_rel_err": worst, "bad": bad[:4], "state_entries": len(twin.opt.state),
                "buffers_finite": all(b is None or bool(torch.isfinite(b).all()) for b in bufs)}
            if bad:
                ctx.fail(f"LIBRARY BUG after {case} + a skipped step: the {twin.label} twin's fused SGD momentum "
                         f"differs from the host-decided unfused SGD: {'; '.join(bad[:3])}")
    ctx.info["oracle"] = results


# 6. Gradients, accumulation, flush, fit --------------------------------------------------------------------------


@scenario("user_zero_grad_and_manual_grads", min_replays=3,
          desc="grad_accum_steps=2 with the user calling zero_grad(set_to_none=False/True) mid-window, setting a "
               "NaN .grad by hand, and zero_grad right after a step; Adam; 20 micro-batches")
def s_user_grads(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16", grad_accum_steps=2))
    for i, batch in enumerate(make_batches(20, seed=23)):
        if i == 5:
            pair.each("zero_grad(set_to_none=False)", lambda t: t.opt.zero_grad(set_to_none=False))
        if i == 9:
            pair.each("model.zero_grad()", lambda t: t.model.zero_grad())
        if i == 13:
            pair.each("head.bias.grad = NaN", lambda t: setattr(t.model.head.bias, "grad",
                                                               torch.full_like(t.model.head.bias, NAN)))
        if i == 16:
            pair.each("zero_grad after a step", lambda t: t.opt.zero_grad())
        pair.step(i, batch)
    pair.final()


@scenario("grad_accum_and_flush_at_odd_points", min_replays=3,
          desc="grad_accum_steps=2 (SGD nesterov) and 3 (AdamW) with flush() after 1 and 2 micro-batches, flush "
               "with nothing open, flush under inference_mode/no_grad, a NaN inside a window")
def s_accum(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_NEST, False), "bf16", grad_accum_steps=2), "accum2")
    b = ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, False), "fp32", grad_accum_steps=3), "accum3")
    data = make_batches(30, seed=24)
    seq = {"accum2": "ssfssfsssfSsssssfsff", "accum3": "ssfsfFsssssssSsIssssNssfss"}
    for p in (a, b):
        k = 0
        for j, c in enumerate(seq[p.name]):
            if c == "s":
                p.step(k, data[k])
                k += 1
            elif c == "S":
                p.step(k, data[k], x_scale=NAN)
                k += 1
            elif c in "fF":
                p.op(f"flush#{j}", lambda t: t.trainer.flush())
            elif c == "I":
                def flush_inf(t):
                    with torch.inference_mode():
                        return t.trainer.flush()
                p.op(f"flush-under-inference_mode#{j}", flush_inf)
            elif c == "N":
                def flush_ng(t):
                    with torch.no_grad():
                        return t.trainer.flush()
                p.op(f"flush-under-no_grad#{j}", flush_ng)
        p.final()


class _Recorder:
    def __init__(self, out):
        self.out = out

    def on_step_end(self, trainer, result):
        self.out.append((trainer.global_step, view(result)))

    def on_epoch_end(self, trainer, record):
        self.out.append(("epoch", view(record)))


@scenario("fit_epochs_scheduler_resume", min_replays=6,
          desc="fit(): 7 batches (one NaN), grad_accum 2 (the last window flushed), epochs=2, StepLR, dropout, "
               "val_loader, periodic checkpoints; then fit(epochs=3) on; and Adam + ReduceLROnPlateau(factor 0.5) "
               "via a DataLoader (pin_memory on CUDA), fit(max_steps=5) then fit(epochs=3, underflow_every=2)")
def s_fit(ctx):
    train, val = make_batches(7, seed=25, nan_at=(3,)), make_batches(2, seed=26)
    a = ctx.pair(std(lambda c: Net(c, dropout=0.25), make_opt(SGD, SGD_NEST, False), "bf16",
                     sched_fn=lambda o, c: torch.optim.lr_scheduler.StepLR(o, 2, 0.5), grad_accum_steps=2), "steplr")

    def fit_a(t, **kw):
        cb = t.extra.setdefault("cb", [])
        return t.trainer.fit(train, val_loader=val, progress=False, callbacks=[_Recorder(cb)], **kw)
    a.op("fit(epochs=2)", lambda t: fit_a(t, epochs=2, checkpoint_dir=ctx.tmp / f"fit_{t.label}",
                                          checkpoint_every=3, keep_last=2))
    a.op("callbacks", lambda t: t.extra["cb"])
    a.op("fit(epochs=3)", lambda t: fit_a(t, epochs=3))
    a.op("callbacks", lambda t: t.extra["cb"])
    a.final()

    cpu_train = make_batches(7, seed=27, nan_at=(5,), device="cpu")
    b = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16",
                     sched_fn=lambda o, c: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0)),
                 "plateau", min_replays=3)  # the second fit's underflow probe keeps every step eager

    def fit_b(t, **kw):
        loader = torch.utils.data.DataLoader(cpu_train, batch_size=None, pin_memory=on_cuda())
        cb = t.extra.setdefault("cb", [])
        return t.trainer.fit(loader, val_loader=val, progress=False, callbacks=[_Recorder(cb)], **kw)
    b.op("fit(epochs=2, max_steps=5)", lambda t: fit_b(t, epochs=2, max_steps=5))
    b.op("fit(epochs=3, underflow_every=2)", lambda t: fit_b(t, epochs=3, underflow_every=2))
    b.op("callbacks", lambda t: t.extra["cb"])
    b.op("underflow_history", lambda t: t.trainer.underflow_history)
    b.final()


@scenario("caller_contexts_no_grad_inference_autocast_dtype", min_replays=3,
          desc="steps under torch.no_grad(), torch.inference_mode() (raises in both?), the caller's fp16/bf16 "
               "autocast, torch.set_default_dtype(float64) during a recapture, detect_anomaly; Adam, accum 2")
def s_contexts(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16", grad_accum_steps=2))
    data = make_batches(24, seed=28)
    k = 0

    def under(cm_fn):
        def fn(t):
            with cm_fn():
                return t.trainer.step(data[k])
        return fn
    for j in range(4):
        pair.step(k, data[k])
        k += 1
    for name, cm in (("no_grad", torch.no_grad), ("no_grad", torch.no_grad),
                     ("autocast", lambda: torch.autocast(CFG.device.split(":")[0],
                                                          dtype=torch.float16 if on_cuda() else torch.bfloat16)),
                     ("autocast", lambda: torch.autocast(CFG.device.split(":")[0],
                                                          dtype=torch.float16 if on_cuda() else torch.bfloat16)),
                     ("detect_anomaly", torch.autograd.detect_anomaly),
                     ("detect_anomaly", torch.autograd.detect_anomaly)):
        pair.op(f"step{k} under {name}", under(cm))
        k += 1
    pair.op(f"step{k} under inference_mode", under(torch.inference_mode))  # backward of inference tensors fails?
    k += 1
    pair.step(k, data[k])
    k += 1

    def flush_inf(t):
        with torch.inference_mode():
            return t.trainer.flush()
    pair.op("flush under inference_mode", flush_inf)
    pair.each("weight_decay change (recapture next)", lambda t: t.opt.param_groups[0].__setitem__("weight_decay", 2**-4))

    def f64(t):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return t.trainer.step(data[k])
        finally:
            torch.set_default_dtype(old)
    for _ in range(4):
        pair.op(f"step{k} under default float64", f64)
        k += 1
    while k < len(data):
        pair.step(k, data[k])
        k += 1
    pair.final()


# 7. Interrupts ----------------------------------------------------------------------------------------------------


class RaisingLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose step raises an injected Ctrl-C while ctl['raise'] == 'sched'."""

    def __init__(self, opt, fn, ctl):
        self._probe_ctl = ctl
        super().__init__(opt, fn)

    def step(self, *a, **k):
        if self._probe_ctl.get("raise") == "sched":
            raise InjectedInterrupt("scheduler.step")
        return super().step(*a, **k)

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "_probe_ctl"}


@scenario("interrupts_at_user_visible_points", min_replays=6,
          desc="KeyboardInterrupt from: a forward pass, a gradient hook, an optimizer step pre-hook registered "
               "mid-run, the scheduler's step (booked at the next step), a global optimizer pre-hook, an optimizer "
               "step post-hook (after the update); training continues; Adam + LambdaLR")
def s_interrupts(ctx):
    # Compared unsettled: a settled compare would book the scheduler's step itself, before the step meant to raise.
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16",
                        sched_fn=lambda o, c: RaisingLambdaLR(o, lambda s: 2.0 ** -(s % 3), c)), settle=False)
    data = make_batches(22, seed=29)
    KI = InjectedInterrupt
    pair.steps(data[:3])
    pair.step(3, data[3], expect=KI, **{"raise": "forward"})
    pair.step(4, data[4])
    pair.step(5, data[5], expect=KI, **{"raise": "grad_hook"})
    pair.step(6, data[6])

    def pre_hook(opt, args, kwargs):
        if pair.ctl.get("raise") == "opt_pre":
            raise KI("optimizer step pre-hook")
    pair.each("register_step_pre_hook", lambda t: t.extra.__setitem__("h", t.opt.register_step_pre_hook(pre_hook)))
    pair.step(7, data[7], expect=KI, **{"raise": "opt_pre"})
    pair.step(8, data[8])  # the hook present: eager in both
    pair.each("remove pre-hook", lambda t: t.extra.pop("h").remove())
    pair.step(9, data[9])
    pair.step(10, data[10])
    pair.step(11, data[11], expect=KI, **{"raise": "sched"})  # row 10's scheduler step raises at step 11
    pair.step(12, data[12])
    pair.step(13, data[13])
    def global_hook(opt, args, kwargs):
        if pair.ctl.get("raise") == "global":
            raise KI("global optimizer pre-hook")
    handle = optim_module.register_optimizer_step_pre_hook(global_hook)
    ctx.cleanup(handle.remove)
    pair.step(14, data[14], expect=KI, **{"raise": "global"})
    pair.step(15, data[15])
    handle.remove()

    def post_hook(opt, args, kwargs):
        if pair.ctl.get("raise") == "opt_post":
            raise KI("optimizer step post-hook")
    pair.each("register_step_post_hook", lambda t: t.extra.__setitem__("h", t.opt.register_step_post_hook(post_hook)))
    w0 = pair.eager.model.fc1.weight.detach().clone()
    gs0, st0 = pair.eager.trainer.global_step, pair.eager.trainer.engine.stats.steps
    pair.step(16, data[16], expect=KI, **{"raise": "opt_post"}, settle=False)
    changed = not torch.equal(w0, pair.eager.model.fc1.weight.detach())
    ctx.info["post_hook_interrupt"] = {"weights_changed": changed,
                                       "global_step_before_after": (gs0, pair.eager.trainer.global_step),
                                       "stats_steps_before_after": (st0, pair.eager.trainer.engine.stats.steps)}
    if changed and pair.eager.trainer.global_step == gs0:
        ctx.note("LIBRARY (eager path too): an exception from an optimizer step post-hook leaves the update applied "
                 "but the step uncounted (global_step, stats, scheduler): engine.optimizer_step calls guard.step "
                 "outside its try/finally")
    pair.each("remove post-hook", lambda t: t.extra.pop("h").remove())
    pair.steps(data[17:], start=17)
    pair.final()


@scenario("interrupts_inside_graph_machinery", cuda_only=True, min_replays=5, sim_ok=True,
          desc="graph twin interrupted (a) in the capture's warm-up, (b) inside the capture, (c) between the LR "
               "refill and the replay (foreach_copy_), (d) right after the replay; the eager twin interrupted at "
               "the matching points (before its unscale / right after its update); training continues")
def s_interrupts_graph(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, not on_cuda()), "bf16",
                        sched_fn=lam(lambda s: 2.0 ** -(s % 2))))
    data = make_batches(14, seed=30)
    KI = InjectedInterrupt
    arm = {"n": None}
    real_fused = torch._fused_sgd_
    real_copy = PL_COMPAT.foreach_copy_

    def fused(*a, **k):
        if arm["n"] is not None:
            arm["n"] -= 1
            if arm["n"] == 0:
                arm["n"] = None
                raise KI("inside torch._fused_sgd_")
        return real_fused(*a, **k)

    def copy_(*a, **k):
        if arm.get("copy"):
            arm["copy"] = False
            raise KI("in foreach_copy_ before the replay")
        return real_copy(*a, **k)
    ctx.patch(torch, "_fused_sgd_", fused)
    ctx.patch(PL_COMPAT, "foreach_copy_", copy_)

    def eager_before_update(t):
        guard = t.trainer.engine.guard

        def raising(*a, **k):
            del guard.unscale_
            raise KI("eager twin: before its unscale")
        guard.unscale_ = raising

    def before(i, how):
        def fn(t):
            if t.is_graph:
                if how == "copy":
                    arm["copy"] = True
                else:
                    arm["n"] = how
            else:
                eager_before_update(t)
            try:
                return t.trainer.step(data[i])
            finally:
                arm["n"], arm["copy"] = None, False
                t.trainer.engine.guard.__dict__.pop("unscale_", None)
        return fn

    class RaiseAfterReplay:
        def __init__(self, real):
            self.real = real

        def replay(self):
            self.real.replay()
            raise KI("right after the replay")

    def after_update(i):
        def fn(t):
            if t.is_graph:
                cap = t.captured
                real = cap._graph
                if real is None:
                    raise ProbeBug("no graph to wrap")
                cap._graph = RaiseAfterReplay(real)
                try:
                    return t.trainer.step(data[i])
                finally:
                    if isinstance(cap._graph, RaiseAfterReplay):
                        cap._graph = real
            guard = t.trainer.engine.guard
            real_step = guard.step

            def step(opt, found):
                real_step(opt, found)
                raise KI("eager twin: right after its update")
            guard.step = step
            try:
                return t.trainer.step(data[i])
            finally:
                del guard.step
        return fn

    pair.step(0, data[0])
    cap = pair.graph.captured
    pair.op("step1 interrupted in the warm-up", before(1, 1), expect=KI)
    ctx.info["captures_after_warmup_interrupt"] = cap.captures
    pair.op("step2 interrupted inside the capture", before(2, 2), expect=KI)
    ctx.info["captures_after_capture_interrupt"] = cap.captures
    pair.steps(data[3:6], start=3, plan={4: dict(x_scale=NAN)})
    if cap.captures < 1:
        raise ProbeBug(f"no capture after the interrupts (captures={cap.captures}, given_up={cap.given_up})")
    pair.op("step6 interrupted before the replay", before(6, "copy"), expect=KI)
    pair.op("step7 interrupted right after the replay/update", after_update(7), expect=KI)
    pair.steps(data[8:], start=8, plan={9: dict(x_scale=NAN)})
    pair.final()
    ctx.info["captures"], ctx.info["replays"] = cap.captures, cap.replays


@scenario("capture_failure_falls_back", cuda_only=True, min_replays=0, allow_give_up=("capture failed",),
          sim_ok=True,
          desc="an exception inside the capture (SGD momentum) and inside the warm-up (AdamW: its step counts went "
               "up and must come back down) gives up with one warning and the step runs eagerly, exact")
def s_capture_failure(ctx):
    fused = not on_cuda()  # the simulated self-test: the Trainer fuses only on CUDA
    for name, opt_fn, target, which in (("sgd-capture", make_opt(SGD, SGD_MOM, fused), "_fused_sgd_", 2),
                                        ("adamw-warmup", make_opt(AdamW, ADAMW, fused), "_fused_adamw_", 1)):
        pair = ctx.pair(std(lambda c: Net(c), opt_fn, "bf16"), name)
        real = getattr(torch, target)
        arm = {"n": None}

        def patched(*a, real=real, arm=arm, **k):
            if arm["n"] is not None:
                arm["n"] -= 1
                if arm["n"] == 0:
                    arm["n"] = None
                    raise RuntimeError("probe: injected failure during capture")
            return real(*a, **k)
        ctx.patch(torch, target, patched)
        data = make_batches(8, seed=31)
        pair.step(0, data[0])

        def armed(t, i=1, arm=arm, which=which):
            if t.is_graph:
                arm["n"] = which
            try:
                return t.trainer.step(data[i])
            finally:
                arm["n"] = None
        pair.op("step1 (capture fails)", armed)
        pair.steps(data[2:], start=2, plan={3: dict(x_scale=NAN)})
        pair.final()
        ctx.close()  # restore the patch before the next pair
        cap = pair.graph.captured
        if cap is not None and (CFG.sim or not CFG.smoke) and (cap.given_up is None or "capture failed" not in cap.given_up):
            ctx.fail(f"[{name}] expected a 'capture failed' give-up, got {cap.given_up!r}")


@scenario("cuda_streams_switching", cuda_only=True, min_replays=4, allow_give_up=("changed 3 times",),
          desc="steps on a side stream (with wait_stream both ways) after steps on the default stream (2 captures), "
               "and steps alternating among three streams (recaptures, the documented give-up)")
def s_streams(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, False), "bf16"), "side", allow_give_up=())
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_NEST, False), "bf16"), "alternate", min_replays=1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def on(stream, batch):
        def fn(t):
            if stream is None:
                return t.trainer.step(batch)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                r = t.trainer.step(batch)
            torch.cuda.current_stream().wait_stream(stream)
            return r
        return fn
    data = make_batches(14, seed=32)
    for i, batch in enumerate(data):
        a.op(f"step{i} on {'s1' if i >= 5 else 'default'}", on(s1 if i >= 5 else None, batch))
        s = [None, s1, s2][i % 3]
        b.op(f"step{i} on {['default', 's1', 's2'][i % 3]}", on(s, batch))
    a.final()
    b.final()


# 8. Skips, verdicts, long runs -----------------------------------------------------------------------------------


@scenario("max_consecutive_skips_then_continue", min_replays=4,
          desc="max_consecutive_skips=3 hit with a scheduler (raised at the next step) and without (blocks of 16 on "
               "CUDA; raised when booked), unsettled compares; training goes on after the RuntimeError")
def s_max_skips(ctx):
    a = ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, False), "bf16", sched_fn=lam(lambda s: 1.0),
                     max_consecutive_skips=3), "sched", settle=False)
    b = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "bf16", max_consecutive_skips=3),
                 "blocks", settle=False)
    data = make_batches(24, seed=33)
    for i, batch in enumerate(data):
        a.step(i, batch, **({"x_scale": NAN} if 3 <= i <= 6 else {}))
        b.step(i, batch, **({"x_scale": NAN} if 2 <= i <= 6 else {}))
    a.op("stats", lambda t: t.trainer.stats)
    b.op("stats", lambda t: t.trainer.stats)
    a.final()
    b.final()


@scenario("steps_without_any_gradient", min_replays=4,
          desc="steps whose loss reaches no parameter (only a leaf outside the optimizer): every .grad None; the "
               "graph must stand aside and the eager step count it as the eager twin does; Adam")
def s_no_grads(ctx):
    def build(twin, graph, ctl):
        model = Net(ctl)
        leaf = torch.zeros((), device=CFG.device, requires_grad=True)

        def loss_fn(out, y):
            if ctl.get("detached"):
                return out.detach().float().sum() * 0 + leaf * 2
            return F.cross_entropy(out, y)
        opt = make_opt(Adam, ADAM, False)(model)
        return dict(trainer=Trainer(model, opt, "bf16", device=CFG.device, loss_fn=loss_fn, graph_optimizer_step=graph))
    pair = ctx.pair(build)
    detached = {3, 7, 8}
    for i, batch in enumerate(make_batches(12, seed=34)):
        pair.step(i, batch, **({"detached": True} if i in detached else {}))
    pair.final()


@scenario("lazy_results_and_verdict_blocks", min_replays=30,
          desc="no scheduler, 40 steps, StepResults kept and read only at the end, counters compared unsettled "
               "(16-row verdict blocks on CUDA), LR changed by hand, verdicts_per_copy=5 mid-run, NaN at 17 and 33")
def s_lazy(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_NEST, False), "bf16"), settle=False)
    for i, batch in enumerate(make_batches(40, seed=35)):
        if i in (5, 10, 20):
            pair.each(f"lr=2**-{4 + i // 5}", lambda t, v=2.0 ** -(4 + i // 5): [g.__setitem__("lr", v)
                                                                              for g in t.opt.param_groups],
                      compare=False)
        if i == 25:
            pair.each("verdicts_per_copy=5", lambda t: setattr(t.trainer.engine, "verdicts_per_copy", 5),
                      compare=False)
        pair.step(i, batch, read=False, keep=True, **({"x_scale": NAN} if i in (17, 33) else {}))
    pair.op("read every kept StepResult", lambda t: t.extra["results"])
    pair.op("stats", lambda t: t.trainer.stats)
    pair.final()


@scenario("long_run_200_steps_lambdalr", min_replays=180,
          desc="200 steps of Adam with a LambdaLR changing the LR every step (2**-(s%5)), NaN every 37 steps, "
               "compared after every step: no drift, one capture")
def s_long(ctx):
    pair = ctx.pair(std(lambda c: Net(c), make_opt(Adam, ADAM, False), "bf16", sched_fn=lam(lambda s: 2.0 ** -(s % 5))))
    data = make_batches(50, seed=36)
    for i in range(200):
        pair.step(i, data[i % 50], **({"x_scale": NAN} if i % 37 == 36 else {}))
    pair.final()
    cap = pair.graph.captured
    if cap is not None and (CFG.sim or not CFG.smoke) and cap.captures != 1:
        ctx.fail(f"expected one capture over 200 steps with only the LR changing, got {cap.captures}")


# 9. Models, precisions, odd parameters ---------------------------------------------------------------------------


@scenario("odd_params_fp64_zero_size_transposed", min_replays=0, allow_give_up=("capture failed",),
          desc="fp32 policy; an fp64 parameter (fp64 loss: fp64 verdict rows), a zero-size parameter and a "
               "transposed (non-contiguous) one; Adam (defaults) and SGD momentum (fused=True)")
def s_odd(ctx):
    a = ctx.pair(std(lambda c: Net(c, odd=True), make_opt(Adam, ADAM, False), "fp32"), "adam")
    b = ctx.pair(std(lambda c: Net(c, odd=True), make_opt(SGD, SGD_MOM, True), "fp32"), "sgd")
    for i, batch in enumerate(make_batches(12, seed=37)):
        a.step(i, batch, **({"x_scale": NAN} if i == 5 else {}))
        b.step(i, batch, **({"x_scale": NAN} if i == 5 else {}))
    a.final()
    b.final()
    for p in (a, b):
        cap = p.graph.captured
        if cap is not None and cap.given_up:
            ctx.note(f"[{p.name}] a legal setup lost its graph: {cap.given_up}")


@scenario("conv_bn_channels_last_bf16", min_replays=6,
          desc="a small Conv-BN net under bf16 (channels_last on CUDA, cudnn deterministic), SGD momentum defaults; "
               "NaN at steps 0 and 5; 12 steps")
def s_conv(ctx):
    pair = ctx.pair(std(lambda c: ConvNet(c), make_opt(SGD, SGD_MOM, False), "bf16"))
    pair.steps(make_batches(12, seed=38, image=12), plan={0: dict(x_scale=NAN), 5: dict(x_scale=NAN)})
    pair.final()


@scenario("precision_fp8", min_replays=4, needs="torchao",
          desc="precision fp8 (torchao float8 on CUDA cc>=8.9; FP8Policy(emulate=True) on the CPU) with inner "
               "Linear layers of 64 features, batch 16, Adam; NaN at step 4")
def s_fp8(ctx):
    from precisionloop import FP8Policy
    if on_cuda():
        if torch.cuda.get_device_capability() < (8, 9):
            raise Skip("fp8 needs compute capability 8.9+")
        policy = "fp8"
    else:
        policy = FP8Policy(emulate=True)
    pair = ctx.pair(std(lambda c: Net(c, d_in=32, hid=64), make_opt(Adam, ADAM, False), policy))
    pair.steps(make_batches(10, seed=39, bs=16, d_in=32), plan={4: dict(x_scale=NAN)})
    pair.final()


@scenario("precision_fp32_tf32_bf16_same_run", min_replays=6,
          desc="the same AdamW run under fp32, tf32 and bf16 (three pairs), with a NaN at the capture step")
def s_precisions(ctx):
    pairs = [ctx.pair(std(lambda c: Net(c), make_opt(AdamW, ADAMW, True), prec), prec) for prec in PRECS]
    for i, batch in enumerate(make_batches(10, seed=40)):
        for p in pairs:
            p.step(i, batch, **({"x_scale": NAN} if i == 1 else {}))
    for p in pairs:
        p.final()


@scenario("sparse_embedding_grads", min_replays=0, allow_give_up=("sparse",),
          desc="nn.Embedding(sparse=True) with SGD(fused=True) and Adam(fused=True) given explicitly: torch's fused "
               "kernels refuse sparse gradients; both twins must fail alike (the graph gives up on 'sparse')")
def s_sparse(ctx):
    g = torch.Generator().manual_seed(41)
    data = [(torch.randint(0, 20, (BS, 5), generator=g).to(CFG.device),
             torch.randint(0, NCLS, (BS,), generator=g).to(CFG.device)) for _ in range(4)]
    for name, cls in (("sgd", SGD), ("adam", Adam)):
        pair = ctx.pair(std(lambda c: EmbNet(c), make_opt(cls, dict(lr=2**-5), True, split=False), "bf16"), name,
                        allow_give_up=("sparse",) if name == "sgd" else ())
        pair.steps(data)
        pair.final()


@scenario("cpu_param_group_on_cuda_trainer", cuda_only=True, min_replays=0, allow_give_up=("capture failed",),
          desc="a 0-dim CPU parameter (a loss temperature) added with add_param_group mid-run to a CUDA Trainer's "
               "Adam: the eager guard groups devices; the graph must not silently skip the CPU update (caveat: "
               "torch's fused CPU Adam reads found_inf.to('cpu', non_blocking=True), a possible race in eager too)")
def s_cpu_param(ctx):
    def build(twin, graph, ctl):
        model = Net(ctl)
        temp = nn.Parameter(torch.ones(()))

        def loss_fn(out, y):
            loss = F.cross_entropy(out, y)
            return loss * temp if ctl.get("temp", False) else loss
        opt = make_opt(Adam, ADAM, False)(model)
        tr = Trainer(model, opt, "bf16", device=CFG.device, loss_fn=loss_fn, graph_optimizer_step=graph)
        return dict(trainer=tr, temp=temp)
    pair = ctx.pair(build)
    data = make_batches(12, seed=42)
    pair.steps(data[:4])
    pair.ctl["temp"] = True
    pair.each("add_param_group([cpu temp])", lambda t: t.opt.add_param_group({"params": [t.extra["temp"]],
                                                                             "lr": 2**-6}))
    pair.steps(data[4:], start=4, plan={7: dict(x_scale=NAN)})
    pair.op("temp", lambda t: t.extra["temp"].detach().clone())
    pair.final()


# 10. Memory and compile --------------------------------------------------------------------------------------------


@scenario("memory_resnet18_bf16", cuda_only=True, min_replays=0, needs="torchvision",
          desc="REPORT: peak torch.cuda.max_memory_allocated of a ResNet18(10 classes), batch 8, 64px, bf16, fused "
               "SGD momentum, 20 steps, graph vs eager (built and measured separately), vs the fp32 parameter size")
def s_memory(ctx):
    import torchvision

    def run(graph, steps=20):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        opt = SGD(model.parameters(), lr=2**-7, momentum=0.875, fused=True)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            tr = Trainer(model, opt, "bf16", device=CFG.device, graph_optimizer_step=graph)
            for i in range(steps):
                tr.step(data[i % 4])
            stats = tr.stats
        torch.cuda.synchronize()
        out = dict(peak_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
                   end_mb=(torch.cuda.memory_allocated() - base) / 2**20,
                   reserved_mb=torch.cuda.memory_reserved() / 2**20, param_mb=param_mb, steps=stats.steps)
        cap = tr.engine.captured
        if cap is not None:
            out.update(captures=cap.captures, replays=cap.replays, given_up=cap.given_up)
        del tr, model, opt, data, cap
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return out
    run(False, steps=3)  # warm-up: cuDNN benchmark cache, cuBLAS workspaces
    eager = run(False)
    graph = run(True)
    eager2 = run(False)
    extra_peak = graph["peak_mb"] - min(eager["peak_mb"], eager2["peak_mb"])
    extra_end = graph["end_mb"] - min(eager["end_mb"], eager2["end_mb"])
    ctx.info["memory"] = dict(eager=eager, graph=graph, eager_again=eager2, extra_peak_mb=round(extra_peak, 2),
                              extra_end_mb=round(extra_end, 2), param_fp32_mb=round(eager["param_mb"], 2),
                              extra_peak_over_params=round(extra_peak / eager["param_mb"], 3))
    ctx.note(f"graph twin extra peak {extra_peak:.1f} MB, extra steady {extra_end:.1f} MB, fp32 params "
             f"{eager['param_mb']:.1f} MB (ratio {extra_peak / eager['param_mb']:.2f}); graph replays "
             f"{graph.get('replays')}, given_up={graph.get('given_up')}")
    if graph.get("replays", 0) < 15:
        ctx.fail(f"ResNet18's graph replayed only {graph.get('replays')} times: {graph.get('given_up')}")


@scenario("compile_reduce_overhead_plus_graph", cuda_only=True, min_replays=5,
          desc="compile=True (reduce-overhead: CUDA-graph trees) on both twins plus the captured optimizer step; "
               "SGD momentum defaults, bf16, NaN at step 5; 10 steps (slow: runs last, time-guarded)")
def s_compile(ctx):
    if CFG.no_compile:
        raise Skip("--no-compile")
    left = CFG.budget - (time.perf_counter() - CFG.t_start)
    if left < CFG.compile_budget:
        raise Skip(f"only {left:.0f}s of the time budget left (needs {CFG.compile_budget}s)")
    ctx.cleanup(torch._dynamo.reset)
    pair = ctx.pair(std(lambda c: Net(c), make_opt(SGD, SGD_MOM, False), "bf16", compile=True))
    # NaN through the data, not ctl: dynamo guards on the ctl dict's values, so a ctl change would recompile
    pair.steps(make_batches(10, seed=43, nan_at=(5,)))
    pair.final()


# ----------------------------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------------------------

# Last: the memory report and compile (time-guarded) on a clean process; then the scenarios that may scribble on freed
# memory (a stale graph) or sync inside a capture, so a poisoned CUDA context costs nothing else.
ORDER_LAST = ["memory_resnet18_bf16", "compile_reduce_overhead_plus_graph", "state_data_rehomed", "state_swap_tensors",
              "adam_tensor_betas_cuda_filled_in_place", "cpu_param_group_on_cuda_trainer"]


def ordered() -> list[dict]:
    first = [s for s in SCENARIOS if s["name"] not in ORDER_LAST]
    last = [s for n in ORDER_LAST for s in SCENARIOS if s["name"] == n]
    return first + last


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_one(spec: dict) -> dict:
    rec = dict(name=spec["name"], desc=spec["desc"], status="PASS", message="", notes=[], info={}, pairs=[],
               warnings={}, traceback=None, time_s=0.0)
    if spec["cuda_only"] and not on_cuda() and not (CFG.sim and spec["sim_ok"]):
        rec.update(status="SKIP", message="CUDA only")
        return rec
    if spec["needs"] and importlib.util.find_spec(spec["needs"]) is None:
        rec.update(status="SKIP", message=f"{spec['needs']} is not installed")
        return rec
    elapsed = time.perf_counter() - CFG.t_start
    if elapsed > CFG.budget:
        rec.update(status="SKIP", message=f"time budget ({CFG.budget}s) used up")
        return rec
    ctx = Ctx(spec)
    t0 = time.perf_counter()
    try:
        spec["fn"](ctx)
        for p in ctx.pairs:
            rec["pairs"].append(p.post_check())
        if ctx.soft:
            rec.update(status="FAIL", message=ctx.soft[0])
    except Finding as e:
        rec.update(status="FAIL", message=str(e), traceback=ctx.graph_tb)
    except Skip as e:
        rec.update(status="SKIP", message=str(e))
    except InjectedInterrupt as e:
        rec.update(status="ERROR", message=f"an injected interrupt escaped the probe: {e}", traceback=tb_tail(e))
    except Exception as e:  # noqa: BLE001
        rec.update(status="ERROR", message=f"{fmt_exc(e)}", traceback=tb_tail(e))
    finally:
        ctx.close()
        rec["time_s"] = round(time.perf_counter() - t0, 2)
        rec["notes"] = ctx.notes
        rec["soft_failures"] = ctx.soft
        rec["info"] = json.loads(json.dumps(ctx.info, default=str))
        if not rec["pairs"]:
            with contextlib.suppress(Exception):
                rec["pairs"] = [{"pair": p.name, "ops": p.ops, "captures": getattr(p.graph.captured, "captures", None),
                                 "replays": getattr(p.graph.captured, "replays", None),
                                 "given_up": getattr(p.graph.captured, "given_up", None)} for p in ctx.pairs]
        for p in ctx.pairs:
            for twin in (p.eager, p.graph):
                ws = [dict(op=w[0], category=w[1], message=w[2][:300], where=w[3]) for w in twin.warnings]
                if ws:
                    rec["warnings"][f"{p.name}:{twin.label}"] = ws[:30] + ([{"truncated": len(ws) - 30}]
                                                                            if len(ws) > 30 else [])
        del ctx
        free_memory()
    return rec


def summary_line(rec: dict) -> str:
    msg = rec["message"]
    pairs = ", ".join(f"{p['pair']}:{p.get('captures', '-')}c/{p.get('replays', '-')}r"
                      + ("/gave-up" if p.get("given_up") else "") for p in rec["pairs"]) if rec["pairs"] else ""
    extra = f" [{pairs}]" if pairs and (CFG.sim or not CFG.smoke) else ""
    notes = f" (+{len(rec['notes'])} notes)" if rec["notes"] else ""
    return f"{rec['status']:5s} {rec['name']:52s} {rec['time_s']:6.2f}s{extra} {msg[:220]}{notes}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="probe_graph.json")
    ap.add_argument("--smoke-cpu", action="store_true", help="both twins eager on the CPU (checks the probe itself)")
    ap.add_argument("--sim-graph-cpu", action="store_true",
                    help="self-test on the CPU: the graph twin's CapturedStep replays a simulated graph eagerly")
    ap.add_argument("--only", default="", help="comma-separated scenario names or substrings")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--budget", type=float, default=190.0, help="seconds after which scenarios not started SKIP")
    ap.add_argument("--compile-budget", type=float, default=90.0,
                    help="seconds of the budget that must be left to start the compile scenario")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.list:
        for s in ordered():
            print(f"{s['name']}: {s['desc']}")
        return 0
    CFG.smoke = args.smoke_cpu or args.sim_graph_cpu
    CFG.sim = args.sim_graph_cpu
    CFG.device = "cpu" if CFG.smoke else "cuda"
    CFG.graph = not CFG.smoke
    CFG.budget, CFG.compile_budget, CFG.no_compile = args.budget, args.compile_budget, args.no_compile
    if not CFG.smoke and not torch.cuda.is_available():
        print("CUDA is not available: run on the GPU machine, or pass --smoke-cpu", file=sys.stderr)
        return 2
    CFG.t_start = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    specs = [s for s in ordered() if not wanted or any(w == s["name"] or w in s["name"] for w in wanted)]
    meta = dict(torch=torch.__version__, python=sys.version.split()[0], smoke_cpu=CFG.smoke, device=CFG.device,
                device_name=torch.cuda.get_device_name() if on_cuda() else "cpu",
                precisionloop=getattr(precisionloop, "__version__", None), argv=sys.argv,
                cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    with contextlib.suppress(Exception):
        import subprocess
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.dirname(THIS_FILE)), timeout=5).stdout.strip()
    print(f"probe_graph: torch {torch.__version__} on {meta['device_name']}"
          f"{' (CPU smoke: both twins eager)' if CFG.smoke else ''}; {len(specs)} scenarios", flush=True)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="probe_graph_") as tmp:
        CFG.tmp = Path(tmp)
        context_lost = None
        for spec in specs:
            if context_lost:
                rec = dict(name=spec["name"], desc=spec["desc"], status="ERROR", time_s=0.0, notes=[], pairs=[],
                           message=f"not run: the CUDA context was lost earlier ({context_lost})")
            else:
                rec = run_one(spec)
                if on_cuda():
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001  (a sticky CUDA error poisons every later scenario)
                        context_lost = f"after {spec['name']}: {fmt_exc(e)}"
                        rec["notes"].append(f"CUDA context lost: {fmt_exc(e)}")
            records.append(rec)
            print(summary_line(rec), flush=True)
            counts = collections.Counter(r["status"] for r in records)
            out_path.write_text(json.dumps(dict(meta=meta, counts=counts, elapsed_s=round(time.perf_counter() - CFG.t_start, 1),
                                                scenarios=records), indent=1, default=str))
    counts = collections.Counter(r["status"] for r in records)
    print(f"probe_graph: {dict(counts)} in {time.perf_counter() - CFG.t_start:.1f}s; full report in {out_path}")
    for r in records:
        if r["status"] in ("FAIL", "ERROR") or r["notes"]:
            print(f"--- {r['status']} {r['name']}: {r['message'][:400]}")
            for n in r.get("soft_failures", [])[1:6]:
                print(f"      also: {n[:300]}")
            for n in r["notes"][:6]:
                print(f"      note: {n[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
