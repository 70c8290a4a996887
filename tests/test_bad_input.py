"""The traps users fall into, each refused at once with an error that names it, before anything changes; and
what those checks must still let through."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from conftest import B, X, Y, _trainer, batch, mk, net, params_of, same_params, tiny_mlp

from precisionloop import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on the CPU:UserWarning")


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


# A malformed batch keeps the gradients accumulated so far ---------------------------------------------------------

@pytest.mark.parametrize("bad", [(X, Y, Y), (X,), [X, Y, Y]])
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
    with pytest.raises(ValueError, match="not a scalar"):
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
    with pytest.raises(ValueError, match="does not require grad"):
        trainer.step((X, Y))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    model.requires_grad_(True)
    trainer.loss_fn = nn.CrossEntropyLoss()
    assert trainer.step((X, Y)).stepped  # the accumulation goes on


def test_a_scheduler_without_an_interval_is_refused_naming_both_choices():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"scheduler_interval.*'step'.*'epoch'"):
        Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="'batch'"):
        Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                scheduler_interval="batch")
    Trainer(model, opt, "fp32", device="cpu", scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))  # implied


def test_fit_over_two_tensors_names_a_loader_of_batches():
    m, t = mk()
    with pytest.raises(TypeError, match=r"fit and evaluate take batches: a DataLoader, or a list of \(inputs, targets\)"):
        t.fit([torch.randn(4, 8), torch.tensor([0, 1, 2, 0])], progress=False)
    assert t.global_step == 0


@pytest.mark.parametrize("batch, names", [(torch.randn(4, 8), "forward_batch"), ({1, 2}, "forward_batch")],
                         ids=["a tensor", "a set"])
def test_a_batch_that_is_not_inputs_and_targets_names_the_method_to_override(batch, names):
    m, t = mk()
    with pytest.raises(TypeError, match=names):
        t.step(batch)
    assert t.global_step == 0 and all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("params, match", [(lambda m: list(m.parameters())[1:], "0.weight"),
                                           (lambda m: [*m.parameters(), nn.Parameter(torch.zeros(2))], "optimizer")],
                         ids=["a parameter missing", "a tensor not of the model"])
def test_an_optimizer_not_holding_exactly_the_models_trainable_parameters_is_refused(params, match):
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.SGD(params(model), lr=0.1), "bf16", device="cpu")


@pytest.mark.parametrize("dtype, match", [(torch.float16, r"0.weight.*float16"), (torch.bfloat16, "bf16-pure")])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_weights_are_refused_under_mixed_precision(precision, dtype, match):
    model = tiny_mlp().to(dtype)
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.AdamW(model.parameters()), precision, device="cpu")
    assert all(p.dtype == dtype for p in model.parameters())


@pytest.mark.parametrize("kwargs, match", [(dict(grad_accum_steps=0), "grad_accum_steps"),
                                           (dict(scheduler=torch.optim.lr_scheduler.CosineAnnealingLR), "scheduler")])
def test_bad_trainer_arguments_are_refused_at_construction(kwargs, match):
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", **kwargs)


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


@pytest.mark.parametrize("loader", [[], torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:3], Y[:3]),
                                                                  batch_size=4, drop_last=True)], ids=["list", "drop_last"])
def test_a_train_loader_with_no_batches_is_refused_before_anything_changes(loader):
    m, t = mk()
    before = params_of(m)
    with pytest.raises(ValueError, match="no batches"):
        t.fit(loader, epochs=1, progress=False)
    assert same_params(m, before) and t.epoch == 0 and t.global_step == 0


def test_fit_trains_over_a_dataloader_of_an_iterable_dataset_without_a_length():
    xs, ys = batch(n=8)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(xs, ys))

    m, t = mk()
    history = t.fit(torch.utils.data.DataLoader(Stream(), batch_size=4), epochs=1, progress=False)
    assert history[0]["steps"] == 2 and history[0]["complete"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_bf16_refuses_an_optimizer_that_rounds_to_nearest_before_changing_anything(dtype):
    model = tiny_mlp().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = params_of(model)
    with pytest.raises(ValueError, match=r"'bf16-pure'.*AdamW does not say.*bf16_stochastic_round = True.*"
                                         r"precisionloop.BF16AdamW\(params\), or precision='bf16'"):
        Trainer(model, opt, "bf16-pure", device="cpu")
    assert all(p.dtype == dtype for p in model.parameters()) and same_params(model, before)


def test_pure_bf16_refuses_fp16_weights():
    model = tiny_mlp().half()
    opt = torch.optim.AdamW(model.parameters())
    opt.bf16_stochastic_round = True  # the declaration alone: the weights are refused first
    with pytest.raises(ValueError, match=r"0.weight \(torch.float16\).*neither fp32 nor bf16.*model.float\(\)"):
        Trainer(model, opt, "bf16-pure", device="cpu")




@pytest.mark.parametrize("norm", [0.0, -1.0])
def test_a_clipping_norm_that_would_zero_every_gradient_is_refused(norm):
    model = tiny_mlp()  # a script's grad_clip=0.0 means no clipping; passed through it would stop training
    with pytest.raises(ValueError, match="None for no clipping"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", max_grad_norm=norm)
