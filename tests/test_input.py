"""The input pipeline: fit's device feed (a side CUDA stream), input_transform and normalize_uint8.

The feed's order of work is checked on the CPU through its streams seam; on CUDA (``gpu``) the feed on and off
train the same weights bit for bit, keep exact resume, and leave no memory or state behind an exception.
"""

import collections
import contextlib
import dataclasses
import functools
import gc
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from conftest import DictTrainer, dict_batch, net, seed_all, tiny_mlp

from precisionloop import Trainer, feed, get_policy, normalize_uint8

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def by_hand(images):
    """What torchvision's ToTensor() then Normalize(MEAN, STD) give, written out."""
    return (images.float() / 255 - torch.tensor(MEAN).view(-1, 1, 1)) / torch.tensor(STD).view(-1, 1, 1)


def uint8_images(n=16, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g), torch.randint(0, 4, (n,), generator=g)


class Probe(nn.Module):
    """A tiny conv classifier that records the dtype and layout of every input it is given."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append((x.dtype, x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()))
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def _probe_trainer(seed=0, **kwargs):
    model = Probe(seed)
    return model, Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", **kwargs)


# normalize_uint8 ------------------------------------------------------------------------------------------------

def test_normalize_uint8_equals_normalising_by_hand():
    images, _ = uint8_images()
    out = normalize_uint8(MEAN, STD)(images)
    assert out.dtype == torch.float32 and torch.equal(out, by_hand(images))


@pytest.mark.parametrize("mean, std, match", [
    ((0.5, 0.5), (0.5,), "one mean and one std per channel, got 2 means and 1 stds"),
    ((), (), "one mean and one std per channel"),
    ((0.5,), (0.0,), "finite means and stds > 0"),
    ((float("nan"),), (0.5,), "finite means and stds > 0"),
    ("abc", (0.5,), "sequences of numbers"),
    ((123.7, 116.3, 103.5), (58.4, 57.1, 57.4), "on the 0-1 scale.*divide them by 255"),
    ((0.5,), (2.0,), "on the 0-1 scale"),
])
def test_normalize_uint8_refuses_bad_statistics(mean, std, match):
    with pytest.raises(ValueError, match=match):
        normalize_uint8(mean, std)


def test_normalize_uint8_refuses_images_that_are_not_uint8():
    with pytest.raises(TypeError, match="normalize_uint8 takes uint8 images .* got torch.float32"):
        normalize_uint8(MEAN, STD)(torch.rand(2, 3, 4, 4))


def test_normalize_uint8_equals_torchvisions_to_tensor_and_normalize():
    transforms = pytest.importorskip("torchvision.transforms")
    images, _ = uint8_images()
    theirs = transforms.Normalize(MEAN, STD)(images.float().div(255))  # what ToTensor + Normalize give per image
    assert torch.allclose(normalize_uint8(MEAN, STD)(images), theirs, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 1, 4, 4), (2, 4, 4, 4), (2, 4, 4), (4, 4), (1, 2, 3, 4, 4)])
def test_normalize_uint8_refuses_images_with_other_channels_than_its_statistics(shape):
    with pytest.raises(ValueError, match=r"C = 3 channels.*got shape"):
        normalize_uint8(MEAN, STD)(torch.zeros(shape, dtype=torch.uint8))


def test_normalize_uint8_with_one_statistic_takes_any_channels():
    out = normalize_uint8((0.5,), (0.25,))(torch.full((2, 1, 2, 2), 255, dtype=torch.uint8))
    assert out.shape == (2, 1, 2, 2) and torch.allclose(out, torch.full_like(out, 2.0))


# input_transform ------------------------------------------------------------------------------------------------

def test_input_transform_runs_in_step_fit_and_evaluate_as_normalising_by_hand():
    images, labels = uint8_images()
    raw = DataLoader(TensorDataset(images, labels), batch_size=4)
    normalised = DataLoader(TensorDataset(by_hand(images), labels), batch_size=4)
    model, trainer = _probe_trainer(input_transform=normalize_uint8(MEAN, STD))
    reference_model, reference = _probe_trainer()
    assert trainer.step((images[:4], labels[:4])).loss == reference.step((by_hand(images[:4]), labels[:4])).loss
    got = trainer.fit(raw, epochs=2, val_loader=raw, progress=False)
    want = reference.fit(normalised, epochs=2, val_loader=normalised, progress=False)
    assert [(r["train_loss"], r["val_loss"]) for r in got] == [(r["train_loss"], r["val_loss"]) for r in want]
    assert trainer.evaluate(raw) == reference.evaluate(normalised)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference_model.parameters(), strict=True))
    assert {dtype for dtype, _ in model.seen} == {torch.float32}  # training, validation and evaluate alike


def test_the_transformed_inputs_take_the_models_layout():
    policy = dataclasses.replace(get_policy("fp32", "cpu"), channels_last=True)
    model = Probe()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu",
                      input_transform=normalize_uint8(MEAN, STD))
    images, labels = uint8_images(4)
    trainer.step((images, labels))
    trainer.evaluate([(images, labels)])
    assert model.seen == [(torch.float32, True)] * 2


@pytest.mark.parametrize("transform, what", [
    (lambda x: None, "NoneType"),
    (lambda x: [x.float()], "list"),
    (lambda x: x.float()[:2], r"a tensor of shape \(2, 3, 8, 8\)"),
    (lambda x: x.float().sum(), r"a tensor of shape \(\)"),
])
def test_an_input_transform_that_returns_no_inputs_of_the_batch_size_is_named_before_the_model_runs(transform, what):
    images, labels = uint8_images(n=4)
    model, trainer = _probe_trainer(input_transform=transform)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=f"input_transform returned {what} for inputs of shape \\(4, 3, 8, 8\\)"):
        trainer.step((images, labels))
    assert model.seen == [] and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_normalize_uint8_given_the_whole_batch_says_how_to_wrap_it():
    m = net()
    trainer = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu",
                          input_transform=normalize_uint8(MEAN, STD))
    with pytest.raises(TypeError, match="got dict .*input_transform gets the whole batch: wrap it"):
        trainer.step(dict_batch(1))


def test_normalize_uint8_passed_uncalled_is_refused_when_the_trainer_is_built():
    model = Probe()
    with pytest.raises(ValueError, match=r"normalize_uint8 cannot be called with one argument.*"
                                         r"normalize_uint8\(mean, std\), called"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu",
                input_transform=normalize_uint8)


def test_transforms_that_take_one_argument_are_accepted_however_they_are_built():
    def scale(x, factor):
        return x * factor

    @functools.wraps(scale)
    def wrapped(x):  # its own signature, not the wrapped function's
        return scale(x, 2.0)

    for transform in (wrapped, functools.partial(scale, factor=2.0), lambda x, k=2.0: x * k, nn.Identity(), torch.neg):
        model = Probe()
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", input_transform=transform)
    with pytest.raises(ValueError, match=r"input_transform scale cannot be called with one argument \(the inputs\)$"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", input_transform=scale)


def test_a_module_transform_with_trainable_parameters_is_refused():
    model, scale = Probe(), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"input_transform Linear has trainable parameters \(weight, bias\), which "
                                         r"only the model's optimizer.*requires_grad_\(False\)"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", input_transform=scale)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu",
            input_transform=scale.requires_grad_(False))


@pytest.mark.parametrize("transform, what", [(lambda b: None, "NoneType"), (lambda b: b["x"], "Tensor")])
def test_a_whole_batch_transform_that_returns_no_batch_is_named_before_the_model_runs(transform, what):
    m = net()
    before = [p.detach().clone() for p in m.parameters()]
    trainer = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu", input_transform=transform)
    with pytest.raises(TypeError, match=f"input_transform returned {what} for a batch that is a dict"):
        trainer.step(dict_batch(1))
    assert trainer.global_step == 0 and all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_a_whole_batch_transform_may_reshape_the_batch():
    m = net()  # a tuple batch made into the dict that DictTrainer's forward_batch reads
    trainer = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu",
                           input_transform=lambda b: {"x": b[0], "y": b[1]})
    b = dict_batch(1)
    assert trainer.step((b["x"], b["y"])).stepped


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in Python 3.11")
def test_uint8_images_without_a_transform_fail_with_a_note_that_names_normalize_uint8():
    model, trainer = _probe_trainer()
    images, labels = uint8_images(n=4)
    for run in (lambda: trainer.step((images, labels)), lambda: trainer.evaluate([(images, labels)])):
        with pytest.raises(RuntimeError) as failed:
            run()
        assert any("input_transform=precisionloop.normalize_uint8(mean, std)" in n for n in failed.value.__notes__)
    assert trainer.global_step == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in Python 3.11")
def test_an_error_that_is_not_the_models_gets_no_uint8_note():
    class ScalesItself(Probe):  # takes uint8 itself, and diverges
        def forward(self, x):
            return super().forward(x.float() / 255) * float("nan")

    model = ScalesItself()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu",
                      max_consecutive_skips=2)
    trainer.step(uint8_images(n=4))
    with pytest.raises(RuntimeError, match="in a row were skipped") as failed:
        trainer.step(uint8_images(n=4))
    assert not getattr(failed.value, "__notes__", [])


def test_a_subclass_with_its_own_batch_shape_gets_the_whole_batch():
    seen = []

    def double_x(batch):
        seen.append(sorted(batch))
        return {**batch, "x": 2 * batch["x"]}

    m, reference_model = net(), net()
    t = DictTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp32", device="cpu", input_transform=double_x)
    reference = DictTrainer(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.1), "fp32", device="cpu")
    b = dict_batch(1)
    assert t.step(b).loss == reference.step({**b, "x": 2 * b["x"]}).loss
    assert t.evaluate([b]) == reference.evaluate([{**b, "x": 2 * b["x"]}])
    assert seen == [["x", "y"]] * 2


def test_autotune_measures_the_candidates_on_the_transformed_inputs(capsys):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "auto", device="cpu", autotune=True,
                      input_transform=lambda x: x.float() / 255)
    x = torch.randint(0, 256, (32, 16), dtype=torch.uint8)  # the model itself refuses uint8 inputs
    assert trainer.step((x, torch.randint(0, 4, (32,)))).stepped
    assert "CHOSEN" in capsys.readouterr().out


# The device feed: its order of work, through the streams seam ---------------------------------------------------

class FakeStreams:
    """Stands in for feed.CudaStreams: records what the feed asks of the streams, in order."""

    def __init__(self, log):
        self.log = log

    @contextlib.contextmanager
    def copying(self, batch):
        self.log.append(("side stream", batch))
        try:
            yield
        finally:
            self.log.append(("back", None))

    def hand_over(self, batch):
        self.log.append(("hand over", batch))


def test_the_feed_moves_each_batch_on_the_side_stream_then_hands_it_over():
    log, end = [], object()
    a, b = torch.zeros(1), torch.ones(1)
    source = iter([(a, "a"), (b, "b")])

    def pull():
        log.append(("pull", None))
        return next(source, end)

    def move(batch):
        log.append(("move", batch[1]))
        return batch[1].upper()

    next_batch = feed.device_feed(pull, move, end, FakeStreams(log))
    assert [next_batch(), next_batch(), next_batch()] == ["A", "B", end]
    assert [(k, v[1] if isinstance(v, tuple) else v) for k, v in log] == [
        ("pull", None), ("side stream", "a"), ("move", "a"), ("back", None), ("hand over", "A"),
        ("pull", None), ("side stream", "b"), ("move", "b"), ("back", None), ("hand over", "B"), ("pull", None)]


def test_a_failed_move_leaves_the_side_stream_and_hands_nothing_over():
    log, batch = [], (torch.zeros(1),)

    def move(batch):
        raise RuntimeError("out of memory")

    next_batch = feed.device_feed(lambda: batch, move, object(), FakeStreams(log))
    with pytest.raises(RuntimeError, match="out of memory"):
        next_batch()
    assert log == [("side stream", batch), ("back", None)]


def test_the_feed_finds_every_tensor_in_a_nested_batch():
    Pair = collections.namedtuple("Pair", "inputs targets")
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    found = list(feed.tensors({"x": [a, (b, "text")], "y": Pair(c, {"z": d}), "n": 3}))
    assert len(found) == 4 and all(any(t is u for u in found) for t in (a, b, c, d))


def test_on_the_cpu_the_feed_is_not_used_and_fit_is_unchanged(monkeypatch):
    def no_streams(device):
        raise AssertionError("the device feed needs CUDA streams; on the CPU it must not be used")

    monkeypatch.setattr(feed, "CudaStreams", no_streams)
    images, labels = uint8_images(12)
    data = DataLoader(TensorDataset(images, labels), batch_size=4, shuffle=True)
    runs = []
    for device_feed in (True, False):
        model, trainer = _probe_trainer(input_transform=normalize_uint8(MEAN, STD))
        torch.manual_seed(0)
        history = trainer.fit(data, epochs=2, progress=False, device_feed=device_feed)
        runs.append(([r["train_loss"] for r in history], [p.detach().clone() for p in model.parameters()]))
    (losses_on, weights_on), (losses_off, weights_off) = runs
    assert losses_on == losses_off and all(torch.equal(p, q) for p, q in zip(weights_on, weights_off, strict=True))


# The device feed on CUDA ----------------------------------------------------------------------------------------

def conv_net(seed=0):
    """Convolutions without batch norm or pooling kernels whose backward adds atomically: deterministic on CUDA."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(2), _Mean(), nn.Linear(8, 4))


class _Mean(nn.Module):
    def forward(self, x):
        return x.mean(2)


@pytest.fixture
def deterministic_cudnn(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)


def _gpu_run(precision, data, device_feed, epochs=3, transform=None, trainer_class=Trainer, **fit):
    model = conv_net()
    trainer = trainer_class(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), precision,
                            device="cuda", input_transform=transform)
    seed_all(0)
    history = trainer.fit(data, epochs=epochs, progress=False, device_feed=device_feed, **fit)
    return trainer, [r["train_loss"] for r in history], [p.detach().clone() for p in model.parameters()]


def _image_loader(dtype, pin_memory, n=64, batch_size=16):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=g)
    images = by_hand(images) if dtype == torch.float32 else images
    return DataLoader(TensorDataset(images, torch.randint(0, 4, (n,), generator=g)), batch_size=batch_size,
                      shuffle=True, pin_memory=pin_memory, generator=torch.Generator().manual_seed(1))


@pytest.mark.gpu
@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "unpinned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=["float32", "uint8"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_feed_changes_no_weight_and_no_loss(precision, dtype, pin_memory, deterministic_cudnn):
    transform = normalize_uint8(MEAN, STD) if dtype == torch.uint8 else None
    # A loader each: its shuffle's generator moves on with every epoch.
    _, losses_off, weights_off = _gpu_run(precision, _image_loader(dtype, pin_memory), False, transform=transform)
    _, losses_on, weights_on = _gpu_run(precision, _image_loader(dtype, pin_memory), True, transform=transform)
    assert losses_on == losses_off
    assert all(torch.equal(p, q) for p, q in zip(weights_on, weights_off, strict=True))


class _ImageDictTrainer(Trainer):
    def forward_batch(self, batch):
        return self.model(batch["image"]["pixels"]), batch["label"]


@pytest.mark.gpu
def test_the_feed_moves_nested_dict_batches(deterministic_cudnn):
    g = torch.Generator().manual_seed(0)
    data = [{"image": {"pixels": torch.randn(8, 3, 16, 16, generator=g).pin_memory()},
             "label": torch.randint(0, 4, (8,), generator=g), "name": "batch"} for _ in range(4)]
    _, losses_off, weights_off = _gpu_run("bf16", data, False, trainer_class=_ImageDictTrainer)
    trainer, losses_on, weights_on = _gpu_run("bf16", data, True, trainer_class=_ImageDictTrainer)
    assert losses_on == losses_off
    assert all(torch.equal(p, q) for p, q in zip(weights_on, weights_off, strict=True))


class _FailingLoader:
    """The batches, but on the epoch given the loader itself raises ``error`` (a type) at the third."""

    def __init__(self, batches, error, fail_on_epoch):
        self.batches, self.error, self.fail_on_epoch, self.epoch = batches, error, fail_on_epoch, 0

    def __iter__(self):
        self.epoch += 1
        for i, b in enumerate(self.batches):
            if self.epoch == self.fail_on_epoch and i == 2:
                raise self.error("from the loader")
            yield b


class _FailingModel(nn.Module):
    def __init__(self, inner, error):
        super().__init__()
        self.inner, self.error, self.calls, self.fail_at = inner, error, 0, None

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error("from the model")
        return self.inner(x)


def _allocated():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["loader", "model"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])  # a type: a new exception each time
def test_an_error_mid_epoch_leaves_no_memory_behind_and_a_second_fit_works(where, error):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 16, 16, generator=g).pin_memory(), torch.randint(0, 4, (8,), generator=g))
               for _ in range(5)]
    model = _FailingModel(conv_net(), error)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "bf16", device="cuda")
    loader = _FailingLoader(batches, error, fail_on_epoch=2 if where == "loader" else 0)
    trainer.fit(loader, epochs=1, progress=False)  # the optimizer state and the workspaces exist from here on
    level = _allocated()
    model.fail_at = model.calls + 3 if where == "model" else None
    with pytest.raises(error):
        trainer.fit(loader, epochs=2, progress=False)
    assert _allocated() == level
    assert trainer.epoch == 1 and trainer.batch_in_epoch == 2  # two batches of the failed epoch were trained
    history = trainer.fit(loader, epochs=3, progress=False)  # the failed epoch's last batches, then a whole one
    assert [r["complete"] for r in history] == [True, True] and trainer.epoch == 3
    assert _allocated() == level


@pytest.mark.gpu
def test_memory_returns_to_its_level_after_fit_with_the_feed():
    data = _image_loader(torch.uint8, True)
    trainer, _, _ = _gpu_run("bf16", data, True, epochs=1, transform=normalize_uint8(MEAN, STD))
    level = _allocated()
    trainer.fit(data, epochs=3, progress=False)
    assert _allocated() == level


@pytest.mark.gpu
def test_a_resume_mid_epoch_with_the_feed_is_exact_and_copies_no_skipped_batch(tmp_path, deterministic_cudnn):
    from test_checkpoints import NoisyDataset  # its samples draw from the global RNG, in this process

    def loader():
        g = torch.Generator().manual_seed(2)
        x = torch.randn(48, 3, 8, 8, generator=g)
        return DataLoader(NoisyDataset(TensorDataset(x, torch.randint(0, 4, (48,), generator=g))), batch_size=8,
                          shuffle=True, pin_memory=True)

    full, _, full_weights = _gpu_run("bf16", loader(), True, epochs=2)
    first, _, _ = _gpu_run("bf16", loader(), True, epochs=2, max_steps=9)  # 6 batches an epoch: stops in the second
    assert first.batch_in_epoch == 3
    first.save(tmp_path / "c.pt")
    seed_all(123)  # a fresh process would start from some other RNG state
    model = conv_net(seed=5)
    resumed = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "bf16", device="cuda")
    resumed.load(tmp_path / "c.pt")
    moved = []
    to_device = resumed.to_device
    resumed.to_device = lambda batch: moved.append(1) or to_device(batch)  # what the feed moves, and only that
    resumed.fit(loader(), epochs=2, progress=False)
    assert len(moved) == 3, "the replayed batches are skipped on the host, never copied"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), full_weights, strict=True))
