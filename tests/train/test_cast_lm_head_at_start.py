"""``model.cast_lm_head_to_fp32`` on a head the fused LM head cannot cast (a LoRA adapter on lm_head, a
quantised weight) is refused when the run starts, once the policy is built and before anything is
sampled, not at the first log-prob pass after a whole step of sampling (issue 53, leftover)."""

from __future__ import annotations

import pytest
import torch
from test_errors import error_line, quickstart_writer
from test_shared_prompt import REWARDS

from lit_grpo.errors import ConfigError
from lit_grpo.train.module import GRPOModule

pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")

REFUSED = "model.cast_lm_head_to_fp32 needs the fused LM head on a torch.nn.Linear of plain tensors; the head is "


@pytest.fixture
def no_sampling(monkeypatch):
    """Sampling (a training step's or a validation step's) fails the test: the refusal must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("sampled before model.cast_lm_head_to_fp32 was refused")

    monkeypatch.setattr(GRPOModule, "generate_and_score", refuse)
    monkeypatch.setattr(GRPOModule, "generate", refuse)


@pytest.mark.usefixtures("fresh_cli", "no_sampling")  # fresh_cli: tests/conftest.py
def test_fit_refuses_the_cast_with_a_lora_adapter_on_the_head_before_sampling(tmp_path, tiny_model_dir, capsys):
    config = quickstart_writer(tmp_path, tiny_model_dir)(model={"lora": {"target_modules": ["q_proj", "lm_head"], "r": 4}})
    message = error_line(capsys, "fit", "--config", str(config), "--model.cast_lm_head_to_fp32", "true")
    assert message == REFUSED + "a LoRA adapter on lm_head (peft.tuners.lora.layer.Linear)"


class QuantisedWeight(torch.nn.Parameter):
    """A weight of another tensor class, as a quantisation library's: the fused head cannot cast it."""


def test_a_quantised_head_weight_is_refused_when_the_optimizer_is_built(tiny_model_dir):
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=2, cast_lm_head_to_fp32=True)
    module.configure_model()
    module.configure_optimizers()  # a plain nn.Linear head: accepted
    head = module.policy.get_output_embeddings()
    head.weight = QuantisedWeight(head.weight.detach())
    with pytest.raises(ConfigError, match=rf"^{REFUSED}a torch.nn.modules.linear.Linear whose weight is a .*QuantisedWeight$"):
        module.configure_optimizers()
    module.hparams.cast_lm_head_to_fp32 = False
    module.apply_settings()
    module.configure_optimizers()  # without the cast the head runs through the module itself: accepted
