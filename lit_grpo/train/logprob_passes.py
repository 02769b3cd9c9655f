"""The log-prob passes: every forward (and backward) of a GRPO step after sampling.

- :meth:`LogProbPasses.completion_logps`: log-probs ``[n, C]`` (and entropy) of the completion tokens
  under the distribution that sampled them (temperature, repetition penalty, top-k/top-p/min-p:
  :mod:`lit_grpo.algorithm.sampling_filters`), for any rows. Each distinct prompt can go through the model once with
  its completions attending to its KV cache (``share_prompt_forward``, :mod:`lit_grpo.train.shared_prompt`),
  and rows of similar length go in separate forwards (``group_by_length``,
  :func:`lit_grpo.rollout.records.length_chunks`); the values are those of one forward over all rows.
- :meth:`~LogProbPasses.chunk_logps`: one forward. Where its logits ``[n, C, V]`` would be more than one
  tile (:data:`lit_grpo.algorithm.fused_lm_head.LOGITS_TILE_BYTES`), the model's body gives hidden
  states and the fused LM head (:mod:`lit_grpo.algorithm.fused_lm_head`) scores them a tile of
  tokens at a time, so no pass holds more logits than a tile; smaller forwards ask the model for its
  logits (the same single head call, no recompute), and so does a model whose head is not known to be
  a linear layer (:func:`lit_grpo.models.output_head`; said once in the log).
- :meth:`~LogProbPasses.sampling_policy_logps` and :meth:`~LogProbPasses.reference_logps`: the
  no-gradient passes of step 4 (``old_logps`` where the policy moves between sampling and an update,
  and the KL reference's).
- :meth:`~LogProbPasses.micro_batch_backward`: forward, GRPO loss (:func:`lit_grpo.algorithm.grpo_loss`)
  and backward of one micro-batch, in chunks of rows within ``forward_token_budget``, skipping the
  backward of rows whose loss terms have no gradient; with the entropy bonus (``model.entropy_coef``),
  the micro-batch's loss carries ``- coefficient * H`` (:func:`lit_grpo.algorithm.entropy_bonus_loss`),
  the entropy with its gradient on both the full-logits path and the fused LM head.

The settings are records built once from the module's hyperparameters (``model.*`` in the config;
:class:`lit_grpo.settings.RunSettings`): the loss's, the sampling distribution's and the passes' own.
Under FSDP2
every forward and backward is a collective, so the ranks agree on how many they run
(:func:`lit_grpo.distributed.agreed_over_sharded_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor

from lit_grpo import algorithm, cpu, models
from lit_grpo.algorithm import fused_lm_head
from lit_grpo.algorithm.losses import LossInputs
from lit_grpo.algorithm.sampling_correction import SamplingCorrection, sampling_correction
from lit_grpo.algorithm.sampling_filters import SamplingFilters, sampling_log_softmax
from lit_grpo.device_defaults import AUTO, CPU_DEFAULTS
from lit_grpo.distributed import agreed_over_sharded_ranks, gather_real_values, root_reshards_after_forward
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.lit_sampler import penalty_skips_left_padding
from lit_grpo.rollout.records import (
    FORWARD_OVERHEAD_TOKENS,
    Rollout,
    ScoredRollout,
    length_chunks,
    position_ids_from_mask,
    split_chunks,
)
from lit_grpo.settings import RunSettings
from lit_grpo.train import packed_forward, packing  # padding_free: the rows of a forward packed into one sequence
from lit_grpo.train.sequence_parallel import SequenceParallel
from lit_grpo.train.shared_prompt import (
    PromptGroups,
    PromptPrefix,
    completion_hidden_states,
    completion_logits,
    distinct_prompts,
    encode_prompts,
    shared_prompt_unsupported,
)

__all__ = ["ENTROPY_WINDOW", "LogProbPasses"]

# the statistic of a micro-batch's [entropy sum, token count] over the tokens of the entropy bonus, for
# adaptive entropy control: the update takes it out of the statistics (it is no metric)
ENTROPY_WINDOW = "entropy_window"


class LogProbPasses:
    """Log-probs, losses and backward passes of a GRPO step, configured by ``settings``.

    Args:
        settings: the run's setting groups (:meth:`lit_grpo.settings.RunSettings.from_hparams`); a
            new record assigned to :attr:`settings` takes effect from the next call.
        all_gather: ``LightningModule.all_gather`` (the entropy threshold of ``top_entropy_quantile``
            is taken over every rank's tokens).
        backward: ``backward(loss, sync)``, the module's manual backward (``sync=False`` keeps DDP
            from all-reducing).
        grad_scale: the loss scale of a ``16-mixed`` GradScaler (1 without one).

    :attr:`entropy_coefficient` is the run's entropy coefficient (:class:`lit_grpo.algorithm.EntropyCoefficient`):
    its state lives across steps (the update steps it, the module checkpoints it) and a new
    :attr:`settings` keeps it unless their entropy settings differ.
    """

    def __init__(
        self,
        settings: RunSettings,
        all_gather: Callable[[torch.Tensor], torch.Tensor],
        backward: Callable[[torch.Tensor, bool], None],
        grad_scale: Callable[[], float],
    ) -> None:
        self.entropy_coefficient: algorithm.EntropyCoefficient | None = None  # made by the settings' setter
        self.settings = settings
        self.all_gather = all_gather
        self.backward = backward
        self.grad_scale = grad_scale
        self._prompt_sharing_notes: set[str] = set()  # reasons share_prompt_forward was not used, said once
        self._fused_head_notes: set[str] = set()  # reasons the fused LM head was not used, said once
        # what the settings left at "auto" are on this run's device (set by the module's setup)
        self.device_defaults: dict[str, Any] = dict(CPU_DEFAULTS)
        # sequence_parallel_size > 1: this rank's group (lit_grpo.train.sequence_parallel), set by the module's setup
        self.sequence_parallel: SequenceParallel | None = None

    @property
    def settings(self) -> RunSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: RunSettings) -> None:
        self._settings = settings
        self.loss_settings = settings.loss
        if self.entropy_coefficient is None or self.entropy_coefficient.settings != settings.entropy:
            self.entropy_coefficient = algorithm.EntropyCoefficient(settings.entropy)
        self.passes = settings.logprobs  # how the passes run
        # the distribution that sampled: temperature, repetition penalty, top-k/top-p/min-p (lit_grpo.algorithm.sampling_filters)
        self.sampling_filters = SamplingFilters.of_run(
            settings.sampling, transformers_penalises_padding=not penalty_skips_left_padding()
        )

    @property
    def forward_token_budget(self) -> int | None:
        value = self.passes.forward_token_budget
        return self.device_defaults["forward_token_budget"] if value == AUTO else value

    @property
    def share_prompt_forward(self) -> bool:
        value = self.passes.share_prompt_forward
        if self.sequence_parallel is not None:  # sequence_parallel: every forward is one packed sequence
            return False
        return self.device_defaults["share_prompt_forward"] if value == AUTO else value

    def padding_free(self, model: torch.nn.Module) -> bool:
        """``padding_free``: whether ``model``'s forwards without a shared prompt pack their rows into
        one sequence (auto: the device's default, where the model can; true where it cannot: ConfigError)."""
        value = self.passes.padding_free
        if value == AUTO:
            return bool(self.device_defaults.get("padding_free")) and packed_forward.packing_unsupported(model) is None
        if value:
            packed_forward.check_packing(model)
        return bool(value)

    # ------------------------------------------------------------------------------------------
    # Log-probs
    # ------------------------------------------------------------------------------------------

    def completion_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool = False, group_by_length: bool = True,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[n, C]`` of the completion tokens (and their entropy) under the sampling distribution.
        The entropy is a metric without gradient, unless ``entropy_grad`` (the entropy bonus).

        With ``share_prompt_forward`` each distinct prompt goes through the model once and its rows'
        completions attend to its KV cache. With ``group_by_length`` (the setting, unless the
        argument turns it off for rows that are already a length chunk) the rows go through the model
        in chunks of similar length, each trimmed to its longest sequence, and come back in their
        original order, padded with 0 to the longest completion ``C`` of the rollout. Either way the
        values are those of one forward over all rows, without the cost of their padding or of
        repeated prompts. Under FSDP2 the ranks agree on both choices (the same number of forwards).
        """
        with cpu.half_attention(model):  # bf16/fp16 on the CPU: attention as matrix products
            return self._completion_logps(model, rollout, with_entropy, group_by_length, entropy_grad)

    def _completion_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool, group_by_length: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        prefix = None
        groups = self.prompt_groups_worth_sharing(model, rollout)
        if groups is not None:
            rollout = rollout.trimmed()  # the prompt columns are fixed here; chunks trim only completions
            head = self.fused_head(model, rollout.completion_ids.numel())
            prefix = encode_prompts(model, rollout.prompt_ids, rollout.prompt_mask, groups, head)
        if self.passes.group_by_length and group_by_length:
            # a shared prompt costs nothing per row: chunk by completion length alone
            prompt_mask = rollout.prompt_mask if prefix is None else rollout.prompt_mask[:, :0]
            if prefix is None and self.padding_free(model):  # padding_free: a packed chunk costs its real tokens
                row_tokens = rollout.prompt_mask.sum(dim=1) + rollout.completion_mask.sum(dim=1)  # [n]
                chunks = packing.token_budget_chunks(row_tokens, self.forward_token_budget)
            else:
                chunks = length_chunks(prompt_mask, rollout.completion_mask, self.forward_token_budget)
            chunks = split_chunks(chunks, agreed_over_sharded_ranks(len(chunks), model, "max"))
        else:
            chunks = [torch.arange(rollout.completion_ids.size(0), device=rollout.completion_ids.device)]
        if len(chunks) == 1:
            return self.chunk_logps(model, rollout.trimmed(prompts=prefix is None), with_entropy, prefix, entropy_grad)
        width = int(rollout.completion_mask.any(dim=0).sum())
        outputs = [
            self.chunk_logps(
                model,
                rollout.select(rows).trimmed(prompts=prefix is None),
                with_entropy,
                prefix.select(rows) if prefix is not None else None,
                entropy_grad,
            )
            for rows in chunks
        ]
        inverse = torch.argsort(torch.cat(chunks))  # position of each original row in the chunk order

        def reassemble(parts: list[torch.Tensor]) -> torch.Tensor:  # [n_chunk, c_chunk] each -> [n, C]
            padded = [torch.nn.functional.pad(part, (0, width - part.size(1))) for part in parts]
            return torch.cat(padded)[inverse]

        logps = reassemble([logps for logps, _ in outputs])
        entropy = reassemble([entropy for _, entropy in outputs]) if with_entropy else None
        return logps, entropy

    def prompt_groups_worth_sharing(self, model: torch.nn.Module, rollout: Rollout) -> PromptGroups | None:
        """The rows' distinct prompts when ``share_prompt_forward`` applies to this model and saves
        more prompt tokens than the extra forward costs (``FORWARD_OVERHEAD_TOKENS``); else None."""
        if not self.share_prompt_forward:
            return None
        reason = shared_prompt_unsupported(model)
        if reason is not None:
            if reason not in self._prompt_sharing_notes:
                self._prompt_sharing_notes.add(reason)
                rank_zero_info(f"model.share_prompt_forward: prompts are encoded with every completion ({reason})")
            return None
        prompt_width = int(rollout.prompt_mask.any(dim=0).sum())  # the trimmed prompt
        groups = distinct_prompts(rollout.prompt_ids, rollout.prompt_mask)
        worth_it = groups.saved_tokens(prompt_width) > FORWARD_OVERHEAD_TOKENS
        # the prompt forward is one more forward: sharded ranks share only if every rank does
        return groups if agreed_over_sharded_ranks(int(worth_it), model, "min") else None

    def fused_head(self, model: torch.nn.Module, tokens: int | None = None) -> models.OutputHead | None:
        """The body and head of ``model`` for the fused LM head, or None where the logits come from
        the model's own forward: a head not known to be linear, or an FSDP2 root unit that frees
        the gathered head after each forward (said once, with the reason), or ``tokens`` whose
        logits fit in one tile (the model's forward then runs the head once, as the fused head
        would; not with ``cast_lm_head_to_fp32``, which only the fused head applies)."""
        head = models.output_head(model)
        if not isinstance(head, str) and root_reshards_after_forward(model):
            head = "its FSDP2 root unit frees the gathered LM head after each forward"
        cast = self.passes.cast_lm_head_to_fp32
        if cast and (isinstance(head, str) or not head.is_linear_layer):
            why = head if isinstance(head, str) else f"the head is {head.description()}"
            raise ConfigError(f"model.cast_lm_head_to_fp32 needs the fused LM head on a torch.nn.Linear of plain tensors; {why}")
        if isinstance(head, str):
            if head not in self._fused_head_notes:
                self._fused_head_notes.add(head)
                split = "" if self.sequence_parallel is None else (  # sequence_parallel: it splits only fused-head forwards
                    f"; model.sequence_parallel_size {self.sequence_parallel.size}: each rank runs these forwards whole, "
                    "no sequence split, no memory saved")
                rank_zero_info(f"log-probs from the model's full logits, not the fused LM head: {head}{split}")
            return None
        tile_bytes = fused_lm_head.tile_bytes_for(next(model.parameters()).device.type, head.vocab_size)
        small = tokens is not None and tokens <= fused_lm_head.tokens_per_tile(head.vocab_size, tile_bytes)
        if not cast and small and self.sequence_parallel is None:  # sequence_parallel: its forwards give hidden states
            return None
        return head

    def check_cast_lm_head_to_fp32(self, model: torch.nn.Module) -> None:
        """Refuse ``model.cast_lm_head_to_fp32`` now, once the policy is built and before any sampling,
        where the fused LM head could not apply it at the first log-prob pass (ConfigError, one line):
        a head that is not a torch.nn.Linear (LoRA on lm_head, an unlisted architecture) or whose weight
        is not a plain tensor (quantised). An FSDP2 weight is still sharded here: the forward gathers it."""
        if not self.passes.cast_lm_head_to_fp32:
            return
        head = self.fused_head(model)  # raises for a head that is not a torch.nn.Linear
        if not isinstance(head.head.weight, DTensor):
            head.fused(float32=True)  # raises for a weight that is not a plain tensor

    def chunk_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool, prefix: PromptPrefix | None = None,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a trimmed rollout (after its shared prompt's forward, given ``prefix``):
        the hidden states ``[n, C, H]`` of the ``C`` positions that predict completion tokens, scored
        by the fused LM head; positions skip left padding exactly as in generation. The entropy has
        its gradient with ``entropy_grad``."""
        if prefix is None:
            head = self.fused_head(model, rollout.completion_ids.numel())
        else:  # as the prompts were encoded: their last hidden states for the fused head, or their logits
            head = self.fused_head(model) if prefix.last_hidden is not None else None
        if head is None:
            return self.chunk_logps_from_logits(model, rollout, with_entropy, prefix, entropy_grad)
        completion_ids = rollout.completion_ids  # [n, C]
        if prefix is not None:
            hidden = completion_hidden_states(model, head, prefix, completion_ids, rollout.completion_mask)
        else:
            # the last completion token predicts nothing that is scored: it is not part of the input
            input_ids = torch.cat([rollout.prompt_ids, completion_ids[:, :-1]], dim=1)  # [n, P + C - 1]
            attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask[:, :-1]], dim=1)
            if self.sequence_parallel is not None:  # sequence_parallel: this rank's slice of the packed rows
                hidden = self.sequence_parallel.hidden_states(model, head, input_ids=input_ids, attention_mask=attention_mask
                                                              )[:, -completion_ids.size(1):]  # [n, C, H]
            elif self.padding_free(model):  # padding_free: one packed sequence, the padding left out
                hidden = packed_forward.packed_hidden_states(model, head, input_ids, attention_mask, completion_ids.size(1))
            else:
                hidden = models.decoder_hidden_states(
                    model, head, input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                )[:, -completion_ids.size(1):]  # [n, C, H]: position P - 1 + t predicts completion token t
        transform = fused_lm_head.sampling_transform(
            self.sampling_filters, completion_ids, head.vocab_size, rollout.prompt_ids, rollout.prompt_mask,
            head.logit_scale, head.softcapping,
        )
        return fused_lm_head.fused_token_logprobs(
            hidden, head.fused(self.passes.cast_lm_head_to_fp32), completion_ids, head.vocab_size, transform, with_entropy,
            fused_lm_head.tile_bytes_for(hidden.device.type, head.vocab_size), entropy_grad=entropy_grad,
        )

    def chunk_logps_from_logits(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool, prefix: PromptPrefix | None = None,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`chunk_logps` from the model's own logits ``[n, C, V]`` (a head not known to be linear).
        Only the ``C`` positions that predict completion tokens get logits (``logits_to_keep``)."""
        if prefix is not None:
            logits = completion_logits(model, prefix, rollout.completion_ids, rollout.completion_mask)  # [n, C, V]
        else:
            # the last completion token predicts nothing that is scored: it is not part of the input
            input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids[:, :-1]], dim=1)  # [n, P + C - 1]
            attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask[:, :-1]], dim=1)
            if self.padding_free(model):  # padding_free: one packed sequence, logits at completion positions only
                logits = packed_forward.packed_logits(model, input_ids, attention_mask, rollout.completion_ids.size(1))
            else:
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask),
                    logits_to_keep=rollout.completion_ids.size(1),
                    use_cache=False,
                ).logits  # [n, C, V]: the last C positions, position P - 1 + t predicts completion token t
        return sampling_log_softmax(
            logits, rollout.completion_ids, self.sampling_filters, rollout.prompt_ids, rollout.prompt_mask,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
        )

    def sampling_policy_logps(self, policy: torch.nn.Module, scored: ScoredRollout, later_rows: torch.Tensor) -> torch.Tensor:
        """``old_logps [N, C]``: the sampling policy's log-probs of ``later_rows`` (the rows trained
        after the first optimizer step), computed now without gradient; 0 for the other rows until
        the first optimizer step's forward fills them (``training_step``).

        With ``skip_zero_gradient_rows``, rows whose policy and KL terms read no old log-probs
        (:func:`lit_grpo.algorithm.rows_without_gradient`: advantage 0 with ``beta = 0``; the entropy
        bonus reads none) or with no token that counts get no pass and keep 0: their old log-probs
        only enter a ratio that is multiplied by a zero advantage or a zero mask, and the clip
        fractions count no token of theirs, so the update and every statistic are the same whatever
        the value; not for a loss type with metrics of its own (``LossType.metrics``: vespo's mean
        ``phi`` counts every row). Sharded (FSDP2)
        ranks compute as many rows as the rank that needs most, so they run as many forwards as each other.
        """
        old_logps = torch.zeros(scored.rollout.completion_ids.shape, device=scored.rollout.completion_ids.device)
        needed = later_rows
        # rows without gradient need no old log-probs, except to reweight another engine's samples
        # or for the loss type's own metrics
        loss_metrics = algorithm.LOSS_TYPES[self.loss_settings.loss_type].metrics
        if self.skips_rows_without_gradient() and scored.rollout.sampling_logps is None and loss_metrics is None:
            loss = self.loss_settings
            inert = algorithm.rows_without_gradient(
                scored.group.advantages[later_rows], scored.loss_mask[later_rows], loss.loss_type, loss.beta
            )  # [n]
            count = agreed_over_sharded_ranks(int((~inert).sum()), policy, "max")  # every rank has n rows
            needed = torch.cat([later_rows[~inert], later_rows[inert]])[:count]
        if len(needed):
            old_logps[needed] = self.logps_no_grad(policy, scored.rollout.select(needed))
        return old_logps

    @torch.no_grad()
    def logps_no_grad(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[N, C]`` without gradient, padded back to the full width, in forwards of
        ``logprob_micro_batch_size`` rows (default ``micro_batch_size``; no backward, so it can be larger)."""
        passes = self.passes
        size = passes.logprob_micro_batch_size or passes.micro_batch_size or rollout.completion_ids.size(0)
        full = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        for start in range(0, rollout.completion_ids.size(0), size):
            rows = torch.arange(start, min(start + size, rollout.completion_ids.size(0)), device=full.device)
            logps, _ = self.completion_logps(model, rollout.select(rows))
            full[rows, : logps.size(1)] = logps
        return full

    def reference_logps(self, policy: torch.nn.Module, ref_model: torch.nn.Module | None, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[N, C]`` of the KL reference: the frozen reference model, or with LoRA the
        policy with its adapter disabled (no second copy of the weights)."""
        with models.reference_model(policy, ref_model) as reference:
            return self.logps_no_grad(reference, rollout)


    # ------------------------------------------------------------------------------------------
    # The loss and its backward pass
    # ------------------------------------------------------------------------------------------

    def micro_batch_loss(
        self, policy: torch.nn.Module, scored: ScoredRollout, rows: torch.Tensor, scale: float = 1.0, bonus_weight: float = 0.0
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """The loss of the micro-batch ``rows`` from one pass (all its chunks' graphs kept), its
        statistics and its log-probs ``[n, C]``; ``scale`` and ``bonus_weight`` as :meth:`policy_loss`'s."""
        micro = scored.rollout.select(rows)
        logps, entropy = self.completion_logps(policy, micro, with_entropy=True, entropy_grad=bonus_weight != 0.0)  # [n, C] each
        return *self.policy_loss(scored, rows, logps, entropy, scale, bonus_weight), logps

    def policy_loss(
        self, scored: ScoredRollout, rows: torch.Tensor, logps: torch.Tensor, entropy: torch.Tensor | None = None,
        scale: float = 1.0, bonus_weight: float = 0.0,
    ) -> tuple[torch.Tensor, dict]:
        """The GRPO loss of the rows ``rows`` given their log-probs ``[n, C]`` (and entropy, for the
        statistics, ``top_entropy_quantile`` and the entropy bonus; None skips them), times ``scale``
        (gradient accumulation), plus the entropy bonus ``- bonus_weight * H`` (``bonus_weight``: the
        optimizer step's coefficient over its micro-batches; ``entropy`` then needs its gradient)."""
        passes = self.passes
        width = logps.size(1)
        loss_mask = scored.loss_mask[rows, :width]
        sampling_logps = scored.rollout.sampling_logps  # [N, C] another engine's (vllm), or None
        sampling_logps = sampling_logps[rows, :width] if sampling_logps is not None else None
        old_logps = scored.old_logps[rows, :width] if scored.old_logps is not None else logps.detach()
        ref_logps = scored.ref_logps[rows, :width] if scored.ref_logps is not None else None
        policy_mask = None
        if passes.top_entropy_quantile < 1.0:  # the threshold is over this micro-batch's tokens on all ranks
            all_entropies = gather_real_values(entropy.detach(), loss_mask, self.all_gather)
            policy_mask = algorithm.high_entropy_mask(entropy, loss_mask, passes.top_entropy_quantile, all_entropies)
        correction = None  # another engine sampled (vllm): its samples reweighted towards the trainer's policy
        if sampling_logps is not None and passes.vllm_importance_sampling_correction:
            correction = sampling_correction(
                old_logps, sampling_logps, loss_mask, passes.vllm_importance_sampling_mode,
                passes.vllm_importance_sampling_clip_min, passes.vllm_importance_sampling_clip_max,
            )
        inputs = LossInputs(
            logps=logps,  # [n, C]
            old_logps=old_logps,  # [n, C]
            advantages=scored.group.advantages[rows],  # [n]
            completion_mask=loss_mask,  # [n, C]
            ref_logps=ref_logps,  # [n, C] or None
            num_items_in_batch=scored.num_items_in_batch,
            policy_mask=policy_mask,  # [n, C] or None
            sampling_weights=None if correction is None else correction.weights,  # [n, C] or [n, 1]
            sampling_logps=sampling_logps,  # [n, C] or None (old_logps): off_policy_mask_threshold's KL
        )
        out = algorithm.grpo_loss(inputs, self.loss_settings)  # the options: self.loss_settings.options
        if entropy is None:
            return out.loss * scale, {}
        stats = {
            # detached: with the bonus on, entropy has a graph (a statistic keeps none); tool tokens left out
            "entropy": algorithm.masked_mean(entropy.detach(), scored.rollout.policy_token_mask[rows, :width]),
            **out.metrics,  # the loss type's own (vespo/phi_seq_mean)
        }
        if out.clip is not None:  # not for a loss type that clips no ratio (vespo), as in TRL
            stats.update({
                "clip_ratio/low_mean": out.clip.low,
                "clip_ratio/high_mean": out.clip.high,
                "clip_ratio/region_mean": out.clip.region,
            })
        if out.kl is not None:
            stats["kl"] = out.kl
        if sampling_logps is not None:
            stats.update(sampling_statistics(old_logps, sampling_logps, loss_mask, correction))
        token_mask = loss_mask if policy_mask is None else loss_mask * policy_mask  # the bonus's tokens: TRL's effective_mask
        return self.with_entropy_bonus(out.loss, stats, entropy, token_mask, scale, bonus_weight)

    def with_entropy_bonus(
        self, policy_loss: torch.Tensor, stats: dict, entropy: torch.Tensor, token_mask: torch.Tensor, scale: float,
        bonus_weight: float,
    ) -> tuple[torch.Tensor, dict]:
        """``policy_loss * scale``, and with the entropy bonus on (``model.entropy_coef``,
        ``use_adaptive_entropy``) ``- bonus_weight * H``, ``H`` the mean of ``entropy [n, C]`` over
        ``token_mask [n, C]`` (:func:`lit_grpo.algorithm.entropy_bonus_loss`), as TRL adds it after the
        loss's accumulation scaling; ``stats`` then get TRL's ``policy_loss`` (the loss before the
        bonus and the scaling) and the :data:`ENTROPY_WINDOW` of adaptive control."""
        loss = policy_loss * scale
        if not self.settings.entropy.enabled:
            return loss, stats
        stats["policy_loss"] = policy_loss.detach()
        stats[ENTROPY_WINDOW] = algorithm.entropy_sum_and_count(entropy, token_mask)
        if bonus_weight != 0.0:
            loss = loss + algorithm.entropy_bonus_loss(entropy, token_mask, bonus_weight)
        return loss, stats

    def micro_batch_backward(
        self, policy: torch.nn.Module, scored: ScoredRollout, rows: torch.Tensor, scale: float, sync: bool,
        bonus_weight: float = 0.0,
    ) -> tuple[dict, torch.Tensor]:
        """See :meth:`_micro_batch_backward`; on the CPU in bf16/fp16 with attention as matrix products."""
        with cpu.half_attention(policy):
            return self._micro_batch_backward(policy, scored, rows, scale, sync, bonus_weight)

    def _micro_batch_backward(
        self, policy: torch.nn.Module, scored: ScoredRollout, rows: torch.Tensor, scale: float, sync: bool,
        bonus_weight: float,
    ) -> tuple[dict, torch.Tensor]:
        """Forward, loss and backward of the micro-batch ``rows``: :meth:`policy_loss` with ``scale``
        and ``bonus_weight``; ``sync=False`` keeps DDP from all-reducing. Returns its statistics
        and its rows' log-probs ``[n, c]`` (detached; c up to its longest completion).

        A micro-batch above ``forward_token_budget`` goes forward and backward in length chunks of
        rows (:meth:`backward_chunks`), so only one chunk's activations are alive at a time. Chunk k
        backpropagates the micro-batch loss with every other row's log-probs held constant: the loss
        is a sum of per-row terms (``rows_independent``), so that is exactly the part of the
        micro-batch gradient that flows through chunk k's rows, and the chunks add up to all of it.
        Shared prompts are encoded once for all chunks: the chunks' backward passes stop at the
        prompts' keys and values, and one last backward carries what they collected through the
        prompt forward. Rows whose loss terms have no gradient (:meth:`rows_without_gradient`) go
        forward without autograd, for the statistics only, and into no chunk.
        """
        micro = scored.rollout.select(rows)
        frozen = self.rows_without_gradient(policy, scored, rows, entropy_bonus=bonus_weight != 0.0)  # [f] positions, or None
        trained = torch.arange(len(rows), device=rows.device)  # [n - f] positions with a backward
        if frozen is not None:
            trained = trained[~torch.isin(trained, frozen)]
        learner = micro.select(trained) if frozen is not None else micro  # the rows that go backward
        may_chunk = self.may_chunk_backward() or frozen is not None
        groups = self.prompt_groups_worth_sharing(policy, learner) if may_chunk else None
        chunks = self.backward_chunks(policy, learner, groups)  # positions in ``learner``
        if frozen is None and len(chunks) == 1:
            loss, stats, logps = self.micro_batch_loss(policy, scored, rows, scale, bonus_weight)
            self.backward(loss, sync)
            stats["loss"] = loss.detach()
            return stats, logps.detach()

        prefix = leaves = None
        if groups is not None:
            learner = learner.trimmed()
            head = self.fused_head(policy, learner.completion_ids.numel())
            prefix = encode_prompts(policy, learner.prompt_ids, learner.prompt_mask, groups, head)
            leaves = prefix.detached()
        logps, entropy = self.logps_before_chunks(policy, scored, rows, frozen)  # [n, C] each
        for index, chunk in enumerate(chunks):
            positions = trained[chunk]  # the chunk's rows in the micro-batch
            chunk_rows = learner.select(chunk).trimmed(prompts=prefix is None)
            chunk_prefix = leaves.select(chunk) if leaves is not None else None
            chunk_logps, chunk_entropy = self.chunk_logps(policy, chunk_rows, True, chunk_prefix, bonus_weight != 0.0)
            padding = (0, logps.size(1) - chunk_logps.size(1))  # [k, c] -> [k, C]
            chunk_logps, chunk_entropy = (torch.nn.functional.pad(part, padding) for part in (chunk_logps, chunk_entropy))
            bonus_entropy = entropy.index_put((positions,), chunk_entropy) if bonus_weight != 0.0 else None  # as logps
            chunk_loss, _ = self.policy_loss(scored, rows, logps.index_put((positions,), chunk_logps), bonus_entropy,
                                             scale, bonus_weight)
            last = index == len(chunks) - 1 and prefix is None
            self.backward(chunk_loss, sync and last)
            logps[positions], entropy[positions] = chunk_logps.detach(), chunk_entropy.detach()
        if prefix is not None:
            # the collected gradient already carries the loss scale (and a GradScaler's, divided out here)
            self.backward(prefix.gradient_surrogate(leaves) / self.grad_scale(), sync)
        with torch.no_grad():  # the loss and statistics of the whole micro-batch, as one pass reports them
            loss, stats = self.policy_loss(scored, rows, logps, entropy, scale, bonus_weight)
        stats["loss"] = loss
        return stats, logps

    def logps_before_chunks(
        self, policy: torch.nn.Module, scored: ScoredRollout, rows: torch.Tensor, frozen: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy ``[n, C]`` of the micro-batch ``rows`` before its chunks run (``C`` its
        longest completion): each row's sampling-policy log-probs (0 without them) as constants until
        its chunk replaces them, and the rows without gradient (positions ``frozen``) computed without
        autograd, for the loss's value and the statistics (their gradient is 0)."""
        micro = scored.rollout.select(rows)
        width = int(micro.completion_mask.any(dim=0).sum())
        if scored.old_logps is not None:
            logps = scored.old_logps[rows, :width].clone()
        else:
            logps = torch.zeros(len(rows), width, device=rows.device)
        entropy = torch.zeros_like(logps)
        if frozen is not None:
            with torch.no_grad():
                frozen_logps, frozen_entropy = self.completion_logps(policy, micro.select(frozen), with_entropy=True)
            padding = (0, width - frozen_logps.size(1))
            logps[frozen] = torch.nn.functional.pad(frozen_logps, padding)
            entropy[frozen] = torch.nn.functional.pad(frozen_entropy, padding)
        return logps, entropy

    def rows_without_gradient(
        self, policy: torch.nn.Module, scored: ScoredRollout, rows: torch.Tensor, entropy_bonus: bool = False
    ) -> torch.Tensor | None:
        """Positions in the micro-batch ``rows`` that need no backward pass, or None.

        ``skip_zero_gradient_rows``: rows whose loss terms have exactly zero gradient
        (:func:`lit_grpo.algorithm.rows_without_gradient`: advantage 0 with ``beta = 0`` and no
        ``entropy_bonus`` in this step's loss, or no token that counts), where their backward would
        cost more than the extra forward they then get (``FORWARD_OVERHEAD_TOKENS``; a backward costs
        about two forwards). Not with
        ``top_entropy_quantile < 1`` (:meth:`skips_rows_without_gradient`). One row always goes
        backward, so the optimizer steps on a zero gradient where no row has any (AdamW's momentum
        and weight decay still move the weights, as after training every row) and DDP all-reduces
        on every rank. Sharded (FSDP2) ranks leave out the same number of rows, so they keep running
        as many forwards and backwards as each other.
        """
        if not self.skips_rows_without_gradient():
            return None
        loss = self.loss_settings
        inert = algorithm.rows_without_gradient(scored.group.advantages[rows], scored.loss_mask[rows], loss.loss_type, loss.beta,
                                                entropy_bonus)
        positions = inert.nonzero().squeeze(1)[: len(rows) - 1]  # [f]
        left_out = rows[positions]
        backward_tokens = 2 * int(scored.rollout.prompt_mask[left_out].sum() + scored.rollout.completion_mask[left_out].sum())
        count = len(positions) if backward_tokens > FORWARD_OVERHEAD_TOKENS else 0
        count = agreed_over_sharded_ranks(count, policy, "min")
        return positions[:count] if count else None

    def skips_rows_without_gradient(self) -> bool:
        """``skip_zero_gradient_rows``, unless ``top_entropy_quantile < 1``, whose threshold is taken
        over every row's entropy in the loss."""
        return self.passes.skip_zero_gradient_rows and self.passes.top_entropy_quantile >= 1.0

    def may_chunk_backward(self) -> bool:
        """Whether the settings let a micro-batch go backward in chunks: ``group_by_length`` with a
        ``forward_token_budget``, and a loss that is a sum of per-row terms (``rows_independent``; not
        ``top_entropy_quantile``, whose threshold needs every row)."""
        passes = self.passes
        if not passes.group_by_length or self.forward_token_budget is None or passes.top_entropy_quantile < 1.0:
            return False
        return algorithm.LOSS_TYPES[self.loss_settings.loss_type].rows_independent

    def backward_chunks(self, policy: torch.nn.Module, micro: Rollout, groups: PromptGroups | None) -> list[torch.Tensor]:
        """The row chunks of a micro-batch for separate forward and backward passes: length chunks
        within ``forward_token_budget`` where the micro-batch's padded tokens exceed it (rows x
        (longest prompt + longest completion), or with shared prompts (``groups``) the distinct
        prompts' tokens plus rows x longest completion), else one chunk; packed (``padding_free``), chunks
        of rows whose real tokens fit the budget."""
        every_row = [torch.arange(micro.completion_ids.size(0), device=micro.completion_ids.device)]
        if not self.may_chunk_backward():
            return every_row
        if groups is None and self.padding_free(policy):  # padding_free: a packed chunk costs its real tokens
            row_tokens = micro.prompt_mask.sum(dim=1) + micro.completion_mask.sum(dim=1)  # [n]
            packed_chunks = packing.token_budget_chunks(row_tokens, self.forward_token_budget)
            return split_chunks(packed_chunks, agreed_over_sharded_ranks(len(packed_chunks), policy, "max"))
        trimmed = micro.trimmed()
        if groups is None:
            tokens, prompt_mask = trimmed.prompt_ids.numel() + trimmed.completion_ids.numel(), micro.prompt_mask
        else:  # a shared prompt costs nothing per row
            tokens = groups.first_row.numel() * trimmed.prompt_ids.size(1) + trimmed.completion_ids.numel()
            prompt_mask = micro.prompt_mask[:, :0]
        if tokens <= self.forward_token_budget:
            chunks = every_row
        else:
            chunks = length_chunks(prompt_mask, micro.completion_mask, self.forward_token_budget)
        return split_chunks(chunks, agreed_over_sharded_ranks(len(chunks), policy, "max"))


def sampling_statistics(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    correction: SamplingCorrection | None,
) -> dict[str, torch.Tensor]:
    """How far the sampling engine's log-probs are from the trainer's (``sampling/*``, TRL's names):
    the mean and largest absolute difference per token, and with the correction on, the importance
    weights (after truncation) and the fraction truncated or masked."""
    real = loss_mask.bool()
    difference = (trainer_logps.detach() - sampling_logps).abs()[real]
    none = torch.tensor(float("nan"))
    stats = {
        "sampling/sampling_logp_difference/mean": difference.mean() if difference.numel() else none,
        "sampling/sampling_logp_difference/max": difference.max() if difference.numel() else none,
    }
    if correction is not None:
        counted = real if correction.weights.size(-1) == real.size(-1) else real.any(dim=-1, keepdim=True)
        weights, changed = correction.weights[counted], correction.changed[counted]
        nan = torch.tensor(float("nan"))  # no token counted here: left out of the step's aggregates
        stats.update({
            "sampling/importance_sampling_ratio/mean": weights.mean() if weights.numel() else nan,
            "sampling/importance_sampling_ratio/min": weights.min() if weights.numel() else nan,
            "sampling/importance_sampling_ratio/max": weights.max() if weights.numel() else nan,
            "sampling/importance_sampling_ratio/truncated_frac": changed.float().mean() if changed.numel() else nan,
        })
    return stats
