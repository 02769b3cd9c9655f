"""A checkpoint is a pickle: lit-grpo reads one only from a local file and with ``weights_only=True``
(lit_grpo/run/checkpointing.py), so that a crafted file cannot run code as it loads. A file holding other
objects, a remote ``--ckpt_path`` and ``--weights_only false`` are each refused in one ``error:`` line,
before anything runs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.cli import main
from lit_grpo.run.checkpointing import AtomicCheckpointIO
from lit_grpo.run.safe_loading import UnsafeCheckpointError, check_shard_metadata

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickled, it writes its marker file: what a crafted checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "the payload ran")


def crafted_checkpoint(path: Path, marker: Path) -> Path:
    """A checkpoint of GRPOModule's shape with a payload among its hyperparameters."""
    torch.save({"state_dict": {}, "hyper_parameters": {"model_name_or_path": "tiny", "payload": Payload(marker)}}, path)
    return path


def error_line(capsys, *args: str) -> str:
    """``lit-grpo ARGS`` must end with status 2 and one ``error:`` line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, lines
    return lines[-1].removeprefix("error: ")


def test_export_refuses_a_checkpoint_with_a_pickled_payload(tmp_path, capsys):
    marker = tmp_path / "marker"
    checkpoint = crafted_checkpoint(tmp_path / "crafted.ckpt", marker)
    message = error_line(capsys, "export", str(checkpoint), str(tmp_path / "out"))
    assert message.startswith(f"{checkpoint} holds a Python object") and "refused (it was not loaded)" in message
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as export reads it
def test_export_refuses_a_sharded_checkpoint_whose_metadata_or_meta_pt_holds_a_payload(tmp_path, capsys):
    from torch.distributed.checkpoint import save

    marker = tmp_path / "marker"
    sharded = tmp_path / "last.ckpt"
    save({"state_dict": {"policy.weight": torch.ones(2, 3)}}, checkpoint_id=str(sharded), no_dist=True)
    check_shard_metadata(sharded)  # DCP's own metadata passes
    crafted_checkpoint(sharded / "meta.pt", marker)
    message = error_line(capsys, "export", str(sharded), str(tmp_path / "out"))
    assert str(sharded / "meta.pt") in message and not marker.exists()

    # torch.distributed.checkpoint unpickles .metadata with a plain pickle.load: checked before
    torch.save({"state_dict": {}, "hyper_parameters": {"model_name_or_path": "tiny"}}, sharded / "meta.pt")
    (sharded / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    message = error_line(capsys, "export", str(sharded), str(tmp_path / "out"))
    assert str(sharded / ".metadata") in message and not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_resume_from_shards_refuses_a_payload_in_a_distcp_file_or_meta_pt_in_one_line(tmp_path):
    """DCP reads a shard's non-tensor items (an optimizer's learning rate) with ``weights_only=False``; a
    resume from shards reads them ``weights_only`` and refuses a payload, naming the checkpoint."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lit_grpo.run.sharded_checkpoints import load_sharded_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    marker = tmp_path / "marker"
    sharded = tmp_path / "last.ckpt"
    saved_state = get_optimizer_state_dict(model, optimizer)  # what Lightning saves as optimizer_0
    saved_state["param_groups"][0]["lr"] = Payload(marker)
    save({"state_dict": model.state_dict(), "optimizer_0": saved_state}, checkpoint_id=str(sharded), no_dist=True)
    torch.save({"global_step": 7}, sharded / "meta.pt")
    check_shard_metadata(sharded)  # the payload is in a .distcp file, not in the metadata
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_sharded_checkpoint(sharded, model, [optimizer])
    assert str(refused.value).startswith(f"{sharded} holds a Python object (") and "\n" not in str(refused.value)
    assert not marker.exists()

    saved_state["param_groups"][0]["lr"] = 0.25  # plain values load, and so does meta.pt
    save({"state_dict": {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, "optimizer_0": saved_state},
         checkpoint_id=str(sharded), no_dist=True)
    assert load_sharded_checkpoint(sharded, model, [optimizer]) == {"global_step": 7}
    assert optimizer.param_groups[0]["lr"] == 0.25 and torch.equal(model.weight, torch.ones(2, 3))

    crafted_checkpoint(sharded / "meta.pt", marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_sharded_checkpoint(sharded, model, [optimizer])
    assert str(refused.value).startswith(f"{sharded / 'meta.pt'} holds a Python object (")
    assert "\n" not in str(refused.value) and not marker.exists()


def test_checkpoint_io_of_a_resume_loads_weights_only_even_when_torch_is_told_otherwise(tmp_path, monkeypatch):
    """Lightning's resume passes ``weights_only=None``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns into
    an unpickling of anything: lit-grpo's CheckpointIO loads with ``True`` all the same."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "marker"
    checkpoint = crafted_checkpoint(tmp_path / "crafted.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match="crafted.ckpt holds a Python object"):
        AtomicCheckpointIO().load_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="weights_only=False"):
        AtomicCheckpointIO().load_checkpoint(checkpoint, weights_only=False)
    assert not marker.exists()
    plain = tmp_path / "plain.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, plain)
    assert AtomicCheckpointIO().load_checkpoint(plain)["global_step"] == 3


@pytest.fixture
def fit_args(tmp_path, tiny_model_dir, monkeypatch, fresh_cli):
    """``lit-grpo fit`` arguments of a small quickstart in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["trainer"].update(max_steps=1, enable_progress_bar=False, enable_model_summary=False)
    config["model"].update(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4)
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return ["fit", "--config", "config.yaml"]


def test_fit_refuses_a_crafted_checkpoint_a_remote_one_and_weights_only_false_in_one_line(fit_args, tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch told to unpickle anything: still refused
    marker = tmp_path / "marker"
    checkpoint = crafted_checkpoint(tmp_path / "crafted.ckpt", marker)
    message = error_line(capsys, *fit_args, "--ckpt_path", str(checkpoint))
    assert message.startswith(f"{checkpoint} holds a Python object") and not marker.exists()

    fetched = []  # Lightning's loader of URLs unpickles with weights_only=False: never reached
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda *args, **kwargs: fetched.append(args))
    for subcommand, url in (("fit", "https://example.com/last.ckpt"), ("validate", "s3://bucket/last.ckpt")):
        message = error_line(capsys, subcommand, *fit_args[1:], "--ckpt_path", url)
        assert message.startswith(f"--ckpt_path {url}: lit-grpo reads checkpoints from local files only")
    assert fetched == []
    message = error_line(capsys, "export", "https://example.com/last.ckpt", str(tmp_path / "out"))
    assert message.startswith("checkpoint https://example.com/last.ckpt: lit-grpo reads checkpoints from local files")

    message = error_line(capsys, *fit_args, "--weights_only", "false")
    assert message.startswith("--weights_only false would let a checkpoint run code")
