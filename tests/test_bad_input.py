"""Bad arguments and input, each refused at once with an error that names it, before anything changes; and
what the checks must still let through. Unchecked, each of these was accepted and failed later (after
training had changed the weights), did something else silently, or failed with torch's own error that named
no valid option.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from conftest import B, X, Y, _params, _trainer, batch, batches, dict_batch, mk, net, opt_state, params_of, same_params, same_state, tiny_mlp

from precisionloop import BF16Policy, FP16Policy, FP32Policy, Trainer, devices, get_policy
from precisionloop.diagnostics import gradient_underflow

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


# Trainer arguments --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(autotune="no"), "autotune must be True or False"),
    (dict(fuse_optimizer="no"), "fuse_optimizer must be True or False"),
    (dict(fuse_optimizer=2), "fuse_optimizer must be True or False"),
    (dict(loss_fn="mse"), "loss_fn must be a callable"),
    (dict(input_transform="normalize"), "input_transform must be a callable .* got 'normalize'"),
    (dict(input_transform=nn.Identity), r"input_transform .* got the class Identity \(pass an instance\)"),
])
def test_trainer_flags_and_loss_fn_of_the_wrong_kind_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _trainer(**kwargs)


@pytest.mark.parametrize("model, optimizer, message", [
    (None, "sgd", "model must be a torch.nn.Module, got NoneType"),
    ("linear", "sgd", "model must be a torch.nn.Module, got str"),
    (nn.Linear(2, 2), None, "optimizer must be a torch.optim.Optimizer .* got NoneType"),
    (nn.Linear(2, 2), "adam", "optimizer must be a torch.optim.Optimizer .* got str"),
])
def test_a_model_or_optimizer_of_the_wrong_kind_is_named(model, optimizer, message):
    if optimizer == "sgd":
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        Trainer(model, optimizer, "fp32", device="cpu")


@pytest.mark.parametrize("device", ["mps", "xpu", "hpu", "lazy", "xla"])
def test_a_device_this_torch_cannot_use_is_refused_with_the_usable_ones(device):
    with pytest.raises(ValueError, match=f"device '{device}' is not usable with this torch build .*; use 'cpu'"):
        _trainer(device=device)


def test_a_cuda_index_past_the_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="'cuda:7' was requested but this machine has 1 CUDA device"):
        devices.resolve_device("cuda:7")


def test_get_policy_refuses_a_bad_device_whatever_the_spec():
    with pytest.raises(ValueError, match="unknown device 'gibberish'"):
        get_policy("bf16", device="gibberish")


# fit's arguments: refused before the first step ---------------------------------------------------------------

class OnStep:
    def on_step_end(self, trainer, result):
        pass


class NotCallable:
    on_step_end = 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(val_loader=5), "val_loader must be an iterable of batches"),
    (dict(val_loader="batches"), "val_loader must be an iterable of batches"),
    (dict(checkpoint_dir=5, checkpoint_every=1), "checkpoint_dir must be a non-empty path"),
    (dict(checkpoint_dir="", checkpoint_every=1), "checkpoint_dir must be a non-empty path"),
    (dict(callbacks=[OnStep]), r"callbacks\[0\] is the class OnStep \(pass an instance\)"),
    (dict(callbacks=[OnStep(), lambda trainer, result: None]), r"callbacks\[1\] is <function"),
    (dict(callbacks=[NotCallable()]), r"callbacks\[0\] is"),
    (dict(progress="False"), "progress must be True or False"),
    (dict(device_feed="no"), "device_feed must be True or False, got 'no'"),
])
def test_fit_refuses_bad_arguments_before_training(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # checkpoint_dir="" once meant the current directory
    t = _trainer()
    before = _weights(t)
    with pytest.raises(ValueError, match=message):
        t.fit([(X, Y)] * 3, **{"progress": False, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(_weights(t), before)) and t.global_step == 0


def test_fit_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("not a directory")
    t = _trainer()
    with pytest.raises(ValueError, match="exists and is not a directory"):
        t.fit([(X, Y)], progress=False, checkpoint_dir=path, checkpoint_every=1)
    assert t.global_step == 0


def test_a_train_loader_that_is_not_iterable_is_named():
    with pytest.raises(ValueError, match=r"train_loader must be an iterable of batches \(.*\), got int"):
        _trainer().fit(5, progress=False)
    with pytest.raises(ValueError, match=r"loader must be an iterable of batches \(.*\), got int"):
        _trainer().evaluate(5)


def test_a_callback_object_without_either_hook_is_refused_naming_what_it_has():
    class Misspelt:
        def on_epoch_ends(self, trainer, record):
            pass

    t = _trainer()
    with pytest.raises(ValueError, match=r"callbacks\[1\] is .*which has neither hook \(it has on_epoch_ends\)"):
        t.fit([(X, Y)], progress=False, callbacks=[OnStep(), Misspelt()])
    with pytest.raises(ValueError, match=r"callbacks\[0\] is <object object.*which has neither hook"):
        t.fit([(X, Y)], progress=False, callbacks=[object()])
    assert t.global_step == 0


# A malformed batch keeps the accumulation window ----------------------------------------------------------------

@pytest.mark.parametrize("bad", [(X, Y, Y), (X,), {"x": X, "y": Y}, [X, Y, Y]])
def test_a_batch_of_the_wrong_shape_keeps_the_open_window(bad):
    t = _trainer(grad_accum_steps=2)
    t.step((X, Y))
    grads = [p.grad.clone() for p in t.model.parameters()]
    with pytest.raises(TypeError, match="expects a batch of \\(inputs, targets\\).*nothing was changed"):
        t.step(bad)
    assert t.engine.micro == 1 and all(torch.equal(p.grad, g) for p, g in zip(t.model.parameters(), grads))
    assert t.step((X, Y)).stepped  # the window closes with both micro-batches


def test_a_subclass_with_its_own_batch_shape_is_not_checked():
    class Triple(Trainer):
        def forward_batch(self, batch):
            inputs, targets, _weights = batch
            return self.model(inputs), targets

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    t = Triple(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step((X, Y, Y)).stepped


# What the checks must still let through ---------------------------------------------------------------------

class StaticHooks:
    @staticmethod
    def on_step_end(trainer, result):
        StaticHooks.calls += 1

    calls = 0


class Batches:
    """Iterable through __getitem__ only, as a Dataset whose items are whole batches."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i >= 2:
            raise IndexError(i)
        return X, Y


def test_loaders_hooks_and_flags_that_python_accepts_still_work():
    t = _trainer(fuse_optimizer=0)
    t.fit(Batches(), progress=0, callbacks=[StaticHooks], val_loader=Batches())
    assert t.global_step == 2 and StaticHooks.calls == 2
    assert set(t.evaluate(Batches())) == {"val_loss"}


def test_a_one_shot_batch_is_not_used_up_by_the_shape_check():
    t = _trainer()
    assert t.step(iter((X, Y))).stepped
    assert t.step(b for b in (X, Y)).stepped


def test_an_optimizer_like_object_is_still_accepted():
    class Wrapped:
        """Not an Optimizer subclass: delegates to one (as some wrappers do)."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    t = Trainer(model, Wrapped(torch.optim.SGD(model.parameters(), lr=0.1)), "fp32", device="cpu")
    before = _weights(t)
    assert t.step((X, Y)).stepped and not torch.equal(_weights(t)[0], before[0])


def test_a_removed_option_names_what_to_use_instead():
    with pytest.raises(ValueError, match=r"graph_optimizer_step.*removed.*compile=True"):
        _trainer(graph_optimizer_step=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        _trainer(no_such_option=1)


def test_max_grad_norm_takes_any_real_number_and_names_the_rule():
    import numpy as np

    t = _trainer(max_grad_norm=np.float32(0.5))
    assert t.step((X, Y)).grad_norm > 0
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0, or None, got -1"):
        _trainer(max_grad_norm=-1)


# autotune and gradient_underflow: arguments refused before any trial ------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(optimizer_factory=3), "optimizer_factory must be a callable"),
    (dict(sample_batch=()), "sample_batch must be a batch"),
    (dict(candidates=["bf16"]), "candidates must be Candidate objects"),
    (dict(tolerance="0.1"), "tolerance='0.1'"),
    (dict(steps="2"), "steps='2'"),
])
def test_autotune_names_a_bad_argument_instead_of_rejecting_every_candidate(kwargs, message):
    from precisionloop import autotune

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    args = dict(model=model, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), sample_batch=(X, Y),
                device="cpu", steps=1, rounds=1, verbose=False)
    with pytest.raises(ValueError, match=message):
        autotune(**{**args, **kwargs})


def test_a_candidate_with_a_compile_mode_torch_lacks_is_refused_when_made():
    from precisionloop import Candidate

    with pytest.raises(ValueError, match="a torch.compile mode among .*got 'max-autotun'"):
        Candidate("bf16", compile="max-autotun")


@pytest.mark.parametrize("kwargs", [dict(dtype="fp16"), dict(dtype=None), dict(dtype=torch.float8_e4m3fn),
                                    dict(scale="65536"), dict(scale=True)])
def test_gradient_underflow_refuses_what_is_not_a_dtype_or_a_scale(kwargs):
    from precisionloop.diagnostics import gradient_underflow

    with pytest.raises(ValueError, match="dtype must be|scale must be"):
        gradient_underflow([("w", torch.tensor([1e-9, 1e-3]))], **kwargs)


# What a new user porting a script tries: refused before anything changes, with the fix named.

def test_fit_refuses_a_dataset_and_names_the_dataloader():
    from torch.utils.data import TensorDataset

    trainer = _trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"train_loader is a TensorDataset.*DataLoader\(dataset, batch_size="):
        trainer.fit(TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))), progress=False)
    with pytest.raises(ValueError, match=r"val_loader is a TensorDataset.*DataLoader"):
        trainer.fit([(X, Y)], val_loader=TensorDataset(X, Y), progress=False)
    assert trainer.global_step == 0 and all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before))


def test_fit_refuses_a_list_of_tensors_and_names_the_dataloader():
    trainer = _trainer()
    with pytest.raises(ValueError, match=r"list of tensors.*DataLoader\(TensorDataset\(inputs, targets\)"):
        trainer.fit([X, Y], progress=False)
    with pytest.raises(ValueError, match="tuple of tensors"):
        trainer.evaluate((X, Y))
    assert trainer.global_step == 0


def test_a_list_of_tensors_is_a_list_of_batches_when_forward_batch_takes_tensors():
    class Tokens(Trainer):  # each batch is one tensor: the inputs are their own targets
        def forward_batch(self, batch):
            return self.model(batch), batch.argmax(dim=1)

    model = nn.Linear(4, 4)
    trainer = Tokens(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    history = trainer.fit([X, X], progress=False)
    assert trainer.global_step == 2 and history[-1]["steps"] == 2


def test_a_loss_class_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"loss_fn is the class CrossEntropyLoss; pass an instance.*CrossEntropyLoss\(\)"):
        _trainer(loss_fn=nn.CrossEntropyLoss)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_loss_that_is_not_a_scalar_is_refused_before_backward_with_the_window_kept(precision):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=2,
                      loss_fn=nn.CrossEntropyLoss(reduction="none"))
    trainer.loss_fn = nn.CrossEntropyLoss()
    trainer.step((X, Y))  # one micro-batch of the window
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    trainer.loss_fn = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match=r"loss_fn .*returned a tensor of shape \(4,\), not a scalar"):
        trainer.step((X, Y))
    assert trainer.engine.micro == 1 and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    trainer.loss_fn = nn.CrossEntropyLoss()
    assert trainer.step((X, Y)).stepped  # the window goes on


@pytest.mark.parametrize("how", ["frozen", "detached", "no_grad"])
def test_a_loss_without_grad_is_refused_before_backward_with_the_window_kept(how):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    trainer.step((X, Y))  # one micro-batch of the window
    grads = [p.grad.clone() for p in model.parameters()]

    def loss_fn(outputs, targets):
        if how == "no_grad":
            with torch.no_grad():
                return nn.functional.cross_entropy(outputs, targets)
        return nn.functional.cross_entropy(outputs.detach() if how == "detached" else outputs, targets)

    trainer.loss_fn = loss_fn
    if how == "frozen":
        model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"returned a loss that does not require grad.*frozen.*nothing was changed"):
        trainer.step((X, Y))
    assert trainer.engine.micro == 1 and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    model.requires_grad_(True)
    trainer.loss_fn = nn.CrossEntropyLoss()
    assert trainer.step((X, Y)).stepped  # the window goes on


def test_a_capturable_optimizer_on_the_cpu_is_refused_at_construction():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="Adam was built with capturable=True.*trains on the CPU: build it with "
                                         "capturable=False"):
        Trainer(model, torch.optim.Adam(model.parameters(), capturable=True), "fp32", device="cpu")


def test_a_scheduler_without_an_interval_is_refused_naming_both_choices():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"needs scheduler_interval: 'step' .* 'epoch'"):
        Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="scheduler_interval must be 'step' or 'epoch', got 'batch'"):
        Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                scheduler_interval="batch")
    with pytest.raises(ValueError, match="without a scheduler"):
        Trainer(model, opt, "fp32", device="cpu", scheduler_interval="step")
    with pytest.raises(ValueError, match="ReduceLROnPlateau.*scheduler_interval='epoch'"):
        Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                scheduler_interval="step")
    Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))  # implied


def test_default_compute_loss_names_the_override():
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    with pytest.raises(TypeError, match="compute_loss"):
        trainer.step(torch.randn(4, 16))


def test_bad_input_at_construction():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="missing from the optimizer.*0.weight"):
        Trainer(model, torch.optim.SGD(list(model.parameters())[1:], lr=0.1), device="cpu")
    with pytest.raises(ValueError, match="not parameters of the model"):
        Trainer(model, torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1), device="cpu")
    half = tiny_mlp().half()
    with pytest.raises(ValueError, match=r"0.weight \(torch.float16\).*model.float\(\)"):
        Trainer(half, torch.optim.SGD(half.parameters(), lr=0.1), device="cpu")
    with pytest.raises(ValueError, match="'fp4'"):
        Trainer(model, opt, "fp4", device="cpu")
    bf16 = tiny_mlp().bfloat16()
    with pytest.raises(ValueError, match=r"0.weight \(torch.bfloat16\).*precision='bf16-pure'.*bf16_stochastic_round=True"):
        Trainer(bf16, torch.optim.AdamW(bf16.parameters()), "bf16", device="cpu")
    for kwargs, key in [(dict(grad_accum_steps=0), "grad_accum_steps"), (dict(grad_accum_steps=1.5), "grad_accum_steps"),
                        (dict(max_consecutive_skips=0), "max_consecutive_skips"), (dict(max_grad_norm=-1.0), "max_grad_norm"),
                        (dict(device="tpu9"), "device")]:
        with pytest.raises(ValueError, match=key):
            Trainer(model, opt, "fp32", **{"device": "cpu", **kwargs})
    other = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler"):
        Trainer(model, opt, device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(other, 1), scheduler_interval="step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_an_error():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="CUDA is not available"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fp64_parameters_rejected_under_mixed_precision(precision):
    """fp64 parameters under bf16/fp16 are a ValueError naming float64."""
    model = net().double()
    with pytest.raises(ValueError, match="float64"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")


def test_fp64_parameters_allowed_under_fp32():
    """fp64 parameters may stay allowed under fp32."""
    model = net().double()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step((B[0].double(), B[1])).stepped


def test_empty_batch_is_a_value_error_that_changes_nothing():
    """An empty batch raises ValueError from step and changes nothing."""
    m, t = mk()
    t.step(B)
    before, state = params_of(m), opt_state(t.optimizer)
    stats, step = dataclasses.asdict(t.stats), t.global_step
    with pytest.raises(ValueError, match="empty"):
        t.step((torch.randn(0, 8), torch.randint(0, 3, (0,))))
    assert same_params(m, before)
    assert same_state(t.optimizer.state_dict(), state)
    assert t.global_step == step and dataclasses.asdict(t.stats) == stats
    assert t.step(batch(2)).stepped


@pytest.mark.parametrize("loader", [[], torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:3], Y[:3]),
                                                                  batch_size=4, drop_last=True)], ids=["list", "drop_last"])
def test_a_train_loader_with_no_batches_is_refused_before_anything_changes(loader):
    m, t = mk()
    before = params_of(m)
    with pytest.raises(ValueError, match=r"train_loader has no batches \(len 0\).*drop_last=True"):
        t.fit(loader, epochs=1, progress=False)
    with pytest.raises(ValueError, match="val_loader has no batches"):
        t.fit([batch(2)], epochs=1, val_loader=loader, progress=False)
    assert same_params(m, before) and t.epoch == 0 and t.global_step == 0


def test_a_generator_is_refused_up_front_when_spent_or_needed_for_several_epochs():
    m, t = mk()
    before = params_of(m)
    with pytest.raises(ValueError, match="train_loader is a generator, an iterator, which can be iterated once only, "
                                         "and fit has 2"):
        t.fit((batch(2) for _ in range(3)), epochs=2, progress=False)
    with pytest.raises(ValueError, match="val_loader is a generator, an iterator, which can be iterated once only"):
        t.fit([batch(2)], epochs=2, val_loader=(batch(2) for _ in range(3)), progress=False)
    for one_shot in (iter([batch(2)] * 3), map(lambda b: b, [batch(2)] * 3)):
        with pytest.raises(ValueError, match=f"train_loader is a {type(one_shot).__name__}, an iterator"):
            t.fit(one_shot, epochs=3, progress=False)
    spent = (batch(2) for _ in range(1))
    list(spent)
    with pytest.raises(ValueError, match="train_loader is a generator that is already spent"):
        t.fit(spent, epochs=1, progress=False)
    assert same_params(m, before) and t.epoch == 0 and t.global_step == 0
    assert t.fit((batch(2) for _ in range(3)), epochs=1, progress=False)[0]["steps"] == 3  # one epoch is fine
    assert t.fit((batch(2) for _ in range(9)), epochs=5, max_steps=5, progress=False)  # max_steps ends it first
    _, t = mk()
    one_shot = iter([batch(2)] * 2)  # with max_steps an iterator may run out after an epoch: the message says so
    with pytest.raises(ValueError, match="yielded no batches in epoch 2.*list_iterator, an iterator, spent"):
        t.fit(one_shot, epochs=5, max_steps=100, progress=False)


def test_an_epoch_whose_loader_yields_nothing_is_refused():
    class Empty:  # an iterable without a length that yields nothing, each epoch
        def __iter__(self):
            return iter(())

    m, t = mk()
    with pytest.raises(ValueError, match="yielded no batches in epoch 1: nothing was trained"):
        t.fit(Empty(), epochs=1, progress=False)
    assert t.epoch == 0 and t.global_step == 0


def test_fit_says_so_when_its_epochs_are_already_done():
    m, t = mk()
    t.fit([batch(2)], epochs=1, progress=False)
    with pytest.warns(UserWarning, match=r"fit\(epochs=1\) has nothing to do: 1 epochs are done already"):
        assert t.fit([batch(2)], epochs=1, progress=False) == []


def test_a_validation_loader_that_yields_nothing_is_refused_not_reported_as_nan():
    m, t = mk()
    with pytest.raises(ValueError, match="validation loader yielded no batches"):
        t.evaluate(b for b in [])
    with pytest.raises(ValueError, match="every one of the validation loader's 2 batches is empty"):
        t.evaluate([(torch.randn(0, 8), torch.randint(0, 3, (0,)))] * 2)
    model = net()
    per_sample = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                         loss_fn=nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match="not a scalar"):
        per_sample.evaluate([batch(2)])


def test_metrics_with_only_compute_loss_overridden_say_that_forward_batch_is_needed():
    class DictLoss(Trainer):
        def compute_loss(self, batch):
            return nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])

    model = net()
    t = DictLoss(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    x, y = batch(2)
    from torchmetrics.classification import MulticlassAccuracy

    with pytest.raises(TypeError, match="override forward_batch too, or pass no metrics"):
        t.evaluate([{"x": x, "y": y}], metrics={"acc": MulticlassAccuracy(num_classes=3)})


def test_fit_trains_over_a_dataloader_of_an_iterable_dataset_without_a_length():
    xs, ys = batch(n=8)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(xs, ys))

    m, t = mk()
    history = t.fit(torch.utils.data.DataLoader(Stream(), batch_size=4), epochs=1, progress=False)
    assert history[0]["steps"] == 2 and history[0]["complete"]


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_gradient_underflow_rejects_bad_scale(scale):
    """gradient_underflow rejects a NaN, infinite, zero or negative scale."""
    grads = [("w", torch.tensor([1e-9, 1e-3, 0.5]))]
    with pytest.raises(ValueError, match="scale"):
        gradient_underflow(grads, torch.float16, scale)


def test_dict_batch_to_default_forward_batch_names_the_override():
    """A 2-key dict batch to the default forward_batch is a TypeError naming forward_batch."""
    _, t = mk()
    with pytest.raises(TypeError, match="forward_batch"):
        t.step(dict_batch(1))


def test_meta_device_is_refused_before_the_model_moves():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="meta"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16", device="meta")
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("kwargs, match", [
    (dict(scheduler=torch.optim.lr_scheduler.CosineAnnealingLR), "scheduler"),
    (dict(max_grad_norm="1"), "max_grad_norm"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"),
])
def test_bad_trainer_arguments_are_refused_at_construction(kwargs, match):
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", **kwargs)


def test_lbfgs_is_refused_at_construction():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="LBFGS"):
        Trainer(model, torch.optim.LBFGS(model.parameters()), "fp32", device="cpu")


@pytest.mark.parametrize("make, match", [
    (lambda: FP16Policy(init_scale=float("inf")), "init_scale"),
    (lambda: FP16Policy(growth_factor=float("inf")), "growth_factor"),
    (lambda: FP32Policy(tf32="no"), "tf32"),
    (lambda: BF16Policy(channels_last="yes"), "channels_last"),
])
def test_bad_policy_arguments_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_fit_arguments_are_refused_before_training(tmp_path):
    model = tiny_mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    before = _params(model)

    class Callback:
        def on_step_end(self, trainer, result):
            pass

    with pytest.raises(ValueError, match="callbacks"):
        trainer.fit(batches(2), progress=False, callbacks=Callback())
    with pytest.raises(ValueError, match="checkpoint_every"):
        trainer.fit(batches(2), progress=False, checkpoint_dir=tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_bf16_refuses_an_optimizer_that_rounds_to_nearest_before_changing_anything(dtype):
    model = tiny_mlp().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = params_of(model)
    with pytest.raises(ValueError, match=r"'bf16-pure'.*AdamW does not say.*bf16_stochastic_round = True.*"
                                         r"torchao.optim._AdamW\(params, bf16_stochastic_round=True\)"):
        Trainer(model, opt, "bf16-pure", device="cpu")
    assert all(p.dtype == dtype for p in model.parameters()) and same_params(model, before)


def test_pure_bf16_refuses_fp16_weights():
    model = tiny_mlp().half()
    opt = torch.optim.AdamW(model.parameters())
    opt.bf16_stochastic_round = True  # the declaration alone: the weights are refused first
    with pytest.raises(ValueError, match=r"0.weight \(torch.float16\).*neither fp32 nor bf16.*model.float\(\)"):
        Trainer(model, opt, "bf16-pure", device="cpu")


def test_pure_bf16_refuses_a_ddp_model_of_fp32_weights_it_would_not_cast(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_mlp()
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters())
        opt.bf16_stochastic_round = True
        with pytest.raises(ValueError, match=r"wrapped in DDP has fp32 parameters \(0.weight, 0.bias.*unwrapped"):
            get_policy("bf16-pure").check_weights(wrapped, opt)
        model.bfloat16()
        get_policy("bf16-pure").check_weights(wrapped, opt)  # cast before wrapping: accepted
    finally:
        dist.destroy_process_group()
