"""The trainer state handed to re-admitted processes holds CPU tensors only (issue 36, item 5).

On a GPU a monitored ``ModelCheckpoint``'s ``best_model_score`` is a CUDA tensor; pickled as it is, it would come
back on rank 0's device index, or fail where ``CUDA_VISIBLE_DEVICES`` hides it. No GPU here: the scores are fake CUDA
tensors (``FakeTensorMode``), whose device is what a real run's would be.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_utilities.core.apply_func import apply_to_collection
from torch._subclasses.fake_tensor import FakeTensorMode

from dynmo_lightning.pipeline.elastic import members as elastic


class _Loop:
    def state_dict(self) -> dict:
        return {"epoch_progress": {"current": {"processed": 1}}}


class _Scheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 3, "base_lrs": [0.1]}


def _devices(state) -> list[torch.device]:
    found: list[torch.device] = []
    apply_to_collection(state, torch.Tensor, lambda t: found.append(t.device))
    return found


def test_captured_state_is_on_the_cpu_before_it_is_pickled(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2)
    with FakeTensorMode(allow_non_fake_inputs=True):  # ModelCheckpoint keeps real CPU tensors too (kth_value)
        checkpoint.best_model_score = torch.empty((), device="cuda")
        checkpoint.current_score = torch.empty((), device="cuda")
        checkpoint.best_k_models = {str(tmp_path / "a.ckpt"): torch.empty((), device="cuda")}
        trainer = SimpleNamespace(
            fit_loop=_Loop(),
            callbacks=[checkpoint],
            lr_scheduler_configs=[SimpleNamespace(scheduler=_Scheduler())],
        )
        before = _devices(checkpoint.state_dict())  # what was pickled until now
        assert [d.type for d in before].count("cuda") == 3
        state = elastic.capture_trainer_state(trainer)
    devices = _devices(state)
    assert len(devices) == len(before) and {d.type for d in devices} == {"cpu"}
    assert state["schedulers"] == [{"last_epoch": 3, "base_lrs": [0.1]}] and state["fit_loop"] == _Loop().state_dict()


def test_real_cpu_state_survives_the_round_trip(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    checkpoint.best_model_score = torch.tensor(0.25)
    trainer = SimpleNamespace(fit_loop=_Loop(), callbacks=[checkpoint], lr_scheduler_configs=[])
    state = pickle.loads(pickle.dumps(elastic.capture_trainer_state(trainer)))  # what `call_back` sends
    assert torch.equal(state["callbacks"][checkpoint.state_key]["best_model_score"], torch.tensor(0.25))
