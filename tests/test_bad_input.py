"""The traps users fall into, each refused at once with an error that names it, before anything changes; and
what those checks must still let through."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from conftest import B, X, Y, _trainer, batch, dict_batch, mk, net, opt_state, params_of, same_params, same_state, tiny_mlp

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


# fit's arguments: refused before the first step ---------------------------------------------------------------

class OnStep:
    def on_step_end(self, trainer, result):
        pass


class NotCallable:
    on_step_end = 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(val_loader=5), "val_loader must be an iterable of batches"),
    (dict(val_loader="batches"), "val_loader must be an iterable of batches"),
    (dict(callbacks=[OnStep]), r"callbacks\[0\] is the class OnStep \(pass an instance\)"),
    (dict(callbacks=[OnStep(), lambda trainer, result: None]), r"callbacks\[1\] is <function"),
    (dict(callbacks=[NotCallable()]), r"callbacks\[0\] is"),
    (dict(callbacks=OnStep()), "callbacks"),
    (dict(progress="False"), "progress must be True or False"),
])
def test_fit_refuses_bad_arguments_before_training(kwargs, message):
    t = _trainer()
    before = _weights(t)
    with pytest.raises(ValueError, match=message):
        t.fit([(X, Y)] * 3, **{"progress": False, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(_weights(t), before)) and t.global_step == 0


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


# A malformed batch keeps the gradients accumulated so far ---------------------------------------------------------

@pytest.mark.parametrize("bad", [(X, Y, Y), (X,), {"x": X, "y": Y}, [X, Y, Y]])
def test_a_batch_of_the_wrong_shape_keeps_the_gradients_accumulated_so_far(bad):
    t = _trainer(grad_accum_steps=2)
    t.step((X, Y))
    grads = [p.grad.clone() for p in t.model.parameters()]
    with pytest.raises(TypeError, match="expects a batch of \\(inputs, targets\\).*nothing was changed"):
        t.step(bad)
    assert all(torch.equal(p.grad, g) for p, g in zip(t.model.parameters(), grads))
    assert t.step((X, Y)).stepped  # the optimizer step takes both micro-batches


def test_a_subclass_with_its_own_batch_shape_is_not_checked():
    class Triple(Trainer):
        def forward_batch(self, batch):
            inputs, targets, _weights = batch
            return self.model(inputs), targets

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    t = Triple(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu")
    assert t.step((X, Y, Y)).stepped


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
def test_a_loss_that_is_not_a_scalar_is_refused_before_backward_and_changes_nothing(precision):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu", grad_accum_steps=2,
                      loss_fn=nn.CrossEntropyLoss(reduction="none"))
    trainer.loss_fn = nn.CrossEntropyLoss()
    trainer.step((X, Y))  # the first of two accumulated micro-batches
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    trainer.loss_fn = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match=r"loss_fn .*returned a tensor of shape \(4,\), not a scalar"):
        trainer.step((X, Y))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    trainer.loss_fn = nn.CrossEntropyLoss()
    assert trainer.step((X, Y)).stepped  # the accumulation goes on


@pytest.mark.parametrize("how", ["frozen", "detached", "no_grad"])
def test_a_loss_without_grad_is_refused_before_backward_and_changes_nothing(how):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", grad_accum_steps=2)
    trainer.step((X, Y))  # the first of two accumulated micro-batches
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
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    model.requires_grad_(True)
    trainer.loss_fn = nn.CrossEntropyLoss()
    assert trainer.step((X, Y)).stepped  # the accumulation goes on


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


@pytest.mark.parametrize("batch, names", [(torch.randn(4, 8), "compute_loss"), (dict_batch(1), "forward_batch")],
                         ids=["a tensor", "a dict"])
def test_a_batch_that_is_not_inputs_and_targets_names_the_method_to_override(batch, names):
    m, t = mk()
    with pytest.raises(TypeError, match=names):
        t.step(batch)
    assert t.global_step == 0 and all(p.grad is None for p in m.parameters())


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


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_fp64_parameters_are_refused_under_mixed_precision_and_train_under_fp32(precision):
    model = net().double()
    make = lambda: Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision, device="cpu")  # noqa: E731
    if precision == "fp32":
        assert make().step((B[0].double(), B[1])).stepped
    else:
        with pytest.raises(ValueError, match="float64"):
            make()


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


def test_a_generator_is_refused_when_fit_needs_several_epochs_and_trains_for_one():
    m, t = mk()
    before = params_of(m)
    with pytest.raises(ValueError, match="train_loader is a generator, an iterator, which can be iterated once only"):
        t.fit((batch(2) for _ in range(3)), epochs=2, progress=False)
    assert same_params(m, before) and t.epoch == 0 and t.global_step == 0
    assert t.fit((batch(2) for _ in range(3)), epochs=1, progress=False)[0]["steps"] == 3


def test_fit_says_so_when_its_epochs_are_already_done():
    m, t = mk()
    t.fit([batch(2)], epochs=1, progress=False)
    with pytest.warns(UserWarning, match=r"fit\(epochs=1\) has nothing to do: 1 epochs are done already"):
        assert t.fit([batch(2)], epochs=1, progress=False) == []


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


@pytest.mark.parametrize("kwargs, match", [
    (dict(scheduler=torch.optim.lr_scheduler.CosineAnnealingLR), "scheduler"),
    (dict(max_grad_norm="1"), "max_grad_norm"),
    (dict(loss_fn="mse"), "loss_fn must be a callable"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"),
])
def test_bad_trainer_arguments_are_refused_at_construction(kwargs, match):
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", **kwargs)


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


