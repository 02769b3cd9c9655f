"""The records of one GRPO step, from sampling to the update, and how their rows are grouped.

N = B * G completions: rows ``g*G .. g*G+G-1`` of every tensor are the group of prompt ``g``.

- :class:`Rollout`: the sampled completions as tensors (prompts left-padded, completions
  right-padded after their EOS);
- :class:`SampledGroups`: a rollout with its rewards and group-relative advantages (steps 1-3);
- :class:`ScoredRollout`: everything the update needs (step 4: the loss mask, the old and reference
  log-probs, the ``dapo`` normaliser);
- :func:`length_chunks` / :func:`split_chunks`: rows of similar length for separate forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from lit_grpo import algorithm
from lit_grpo.distributed import gather_rows

__all__ = [
    "FORWARD_OVERHEAD_TOKENS",
    "Rollout",
    "SampledGroups",
    "ScoredRollout",
    "as_completions",
    "concat_rollouts",
    "decode_completions",
    "is_conversational",
    "length_chunks",
    "position_ids_from_mask",
    "rollout_statistics",
    "score_groups",
    "split_chunks",
]


@dataclass
class Rollout:
    """The completions of one generation batch, as tensors on the policy's device. N = B * G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, C] sampled tokens, padding after EOS
    completion_mask: torch.Tensor  # [N, C] 1 on real completion tokens (up to and including EOS)
    is_truncated: torch.Tensor  # [N] bool, True when the completion hit max_completion_length
    prompt_truncated: torch.Tensor | None = None  # [N] bool, True where max_prompt_length cut the prompt
    sampling_logps: torch.Tensor | None = None  # [N, C] the engine's log-probs of the sampled tokens (vllm backend)
    # multi-turn rollouts with tools (lit_grpo.rollout.tools.multi_turn): [N, C] 1 on the tokens the policy
    # generated, 0 on tool messages and template tokens between its turns; and each row's conversation
    tool_mask: torch.Tensor | None = None
    conversations: list | None = None  # [N] lit_grpo.rollout.tools.multi_turn.Conversation
    # [N] the policy version (optimizer steps taken) whose weights sampled each row (lit_grpo.rollout.engines)
    weight_versions: torch.Tensor | None = None

    @property
    def policy_token_mask(self) -> torch.Tensor:  # [N, C] the tokens that count in the loss
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N] tokens the policy sampled (tool messages left out)
        return self.policy_token_mask.sum(dim=1)

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The rollout restricted to ``rows`` (a micro-batch)."""
        return Rollout(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            is_truncated=self.is_truncated[rows],
            prompt_truncated=None if self.prompt_truncated is None else self.prompt_truncated[rows],
            sampling_logps=None if self.sampling_logps is None else self.sampling_logps[rows],
            tool_mask=None if self.tool_mask is None else self.tool_mask[rows],
            conversations=None if self.conversations is None else [self.conversations[i] for i in rows.tolist()],
            weight_versions=None if self.weight_versions is None else self.weight_versions[rows],
        )

    def trimmed(self, prompts: bool = True) -> "Rollout":
        """Drop the prompt columns that are padding in every row (unless ``prompts=False``) and
        completion columns after the longest completion, so a micro-batch costs only as much as its
        longest sequence."""
        first_prompt_col = int(self.prompt_mask.any(dim=0).int().argmax()) if prompts and self.prompt_mask.any() else 0
        completion_cols = int(self.completion_mask.any(dim=0).sum())
        return Rollout(
            prompt_ids=self.prompt_ids[:, first_prompt_col:],
            prompt_mask=self.prompt_mask[:, first_prompt_col:],
            completion_ids=self.completion_ids[:, :completion_cols],
            completion_mask=self.completion_mask[:, :completion_cols],
            is_truncated=self.is_truncated,
            prompt_truncated=self.prompt_truncated,
            sampling_logps=None if self.sampling_logps is None else self.sampling_logps[:, :completion_cols],
            tool_mask=None if self.tool_mask is None else self.tool_mask[:, :completion_cols],
            conversations=self.conversations,
            weight_versions=self.weight_versions,
        )


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts left-padded, completions right-padded. Every part has
    behaviour log-probs (``sampling_logps``) or none has: a mix would train the whole batch uncorrected."""
    if len({r.sampling_logps is None for r in rollouts}) > 1:
        raise ValueError("concat_rollouts: some rollouts have sampling_logps and others not (each round of a batch must "
                         "carry its behaviour log-probs, or none may)")
    prompt_width = max(r.prompt_ids.size(1) for r in rollouts)
    completion_width = max(r.completion_ids.size(1) for r in rollouts)

    def pad(tensor: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
        missing = width - tensor.size(1)
        return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, prompt_width, pad_token_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, prompt_width, 0, True) for r in rollouts]),
        completion_ids=torch.cat([pad(r.completion_ids, completion_width, pad_token_id, False) for r in rollouts]),
        completion_mask=torch.cat([pad(r.completion_mask, completion_width, 0, False) for r in rollouts]),
        is_truncated=torch.cat([r.is_truncated for r in rollouts]),
        prompt_truncated=(
            None if any(r.prompt_truncated is None for r in rollouts) else torch.cat([r.prompt_truncated for r in rollouts])
        ),
        sampling_logps=(
            None
            if any(r.sampling_logps is None for r in rollouts)
            else torch.cat([pad(r.sampling_logps, completion_width, 0, False) for r in rollouts])
        ),
        tool_mask=(
            None
            if any(r.tool_mask is None for r in rollouts)
            else torch.cat([pad(r.tool_mask, completion_width, 0, False) for r in rollouts])
        ),
        conversations=(
            None if any(r.conversations is None for r in rollouts) else [c for r in rollouts for c in r.conversations]
        ),
        weight_versions=(
            None if any(r.weight_versions is None for r in rollouts) else torch.cat([r.weight_versions for r in rollouts])
        ),
    )


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> tuple[list[str], list[list[int]]]:
    """Completion texts (special tokens removed) and their real token ids, one per completion."""
    completion_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
    ]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return texts, completion_ids


def is_conversational(prompt) -> bool:
    """A prompt is conversational when it is a list of chat messages."""
    return isinstance(prompt, list)


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions as the rewards receive them: the text, or for a chat prompt the assistant's
    message ``[{"role": "assistant", "content": text}]`` (TRL's convention)."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
        for prompt, text in zip(prompts, texts)
    ]


def score_groups(
    scorer, group_prompts: list, group_columns: dict[str, list], texts: list[str], completion_ids: list[list[int]], k: int,
    conversations: list | None = None,
) -> tuple[list, torch.Tensor]:
    """Score ``k`` completions of each of ``group_prompts`` with ``scorer`` (a
    ``lit_grpo.scoring.RewardScorer``): each prompt and each value of its dataset columns repeated
    for its k completions, as every reward sees one prompt, one completion and one value of each
    column. Returns the completions as the rewards received them (:func:`as_completions`; for
    multi-turn ``conversations``, the messages after the prompt) and the ``[B * k, K]`` reward matrix."""
    prompts = [prompt for prompt in group_prompts for _ in range(k)]
    if conversations is not None:
        prompts = [conversation.prompt for conversation in conversations]
        completions = [conversation.messages for conversation in conversations]
    else:
        completions = as_completions(prompts, texts)
    columns = {name: [value for value in values for _ in range(k)] for name, values in group_columns.items()}
    return completions, scorer(prompts, completions, completion_ids, columns)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: ``[n, L] -> [n, L]``."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass
class ScoredRollout:
    """A rollout with everything the update needs. N = B * G completions, C completion tokens."""

    rollout: Rollout
    loss_mask: torch.Tensor  # [N, C] completion tokens that count in the loss
    rewards_per_func: torch.Tensor  # [N, K] NaN where a reward returned None
    rewards: torch.Tensor  # [N] weighted sum, NaN where every reward returned None
    group: algorithm.GroupAdvantages  # advantages [N] and the group statistics behind them
    # [N, C] sampling policy, None when it equals the current policy; the rows of the first optimizer
    # step fill theirs during that step (``training_step``)
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None  # [N, C] reference model, None when beta == 0
    num_items_in_batch: float  # generation batch's real completion tokens, all ranks, / world size / steps_per_generation
    timings: dict[str, float]  # seconds spent in each phase of the step (generate, rewards, logprobs, train)
    prompts: list  # [B] the prompts of the groups (with dynamic sampling, not only the step's batch)
    dynamic_sampling: dict[str, torch.Tensor] | None = None  # dropped_frac and rounds, when enabled


@dataclass
class SampledGroups:
    """Steps 1-3 for some prompts: their groups of G completions, rewards and advantages. N = B * G."""

    prompts: list  # [B] one entry per group
    rollout: Rollout
    completions: list  # [N] as the rewards saw them (text, or assistant messages)
    rewards_per_func: torch.Tensor  # [N, K]
    rewards: torch.Tensor  # [N]
    group: algorithm.GroupAdvantages

    def informative_groups(self, G: int) -> torch.Tensor:
        """``[B]`` True where the group's rewards differ (advantages not all zero)."""
        return ~self.group.zero_std.view(-1, G).all(dim=1)

    def group_slice(self, g: int, G: int) -> "SampledGroups":
        rows = torch.arange(g * G, (g + 1) * G, device=self.rewards.device)
        return SampledGroups(
            prompts=[self.prompts[g]],
            rollout=self.rollout.select(rows),
            completions=self.completions[g * G : (g + 1) * G],
            rewards_per_func=self.rewards_per_func[rows],
            rewards=self.rewards[rows],
            group=self.group.rows(rows),
        )

    @staticmethod
    def concat(parts: list["SampledGroups"], pad_token_id: int) -> "SampledGroups":
        return SampledGroups(
            prompts=[prompt for part in parts for prompt in part.prompts],
            rollout=concat_rollouts([part.rollout for part in parts], pad_token_id).trimmed(),
            completions=[c for part in parts for c in part.completions],
            rewards_per_func=torch.cat([part.rewards_per_func for part in parts]),
            rewards=torch.cat([part.rewards for part in parts]),
            group=algorithm.GroupAdvantages(
                *(torch.cat([getattr(part.group, field) for part in parts]) for field in ("advantages", "group_mean", "group_std", "zero_std"))
            ),
        )


# a forward pass costs about this many padded tokens' work on top of its tokens (kernel launches,
# Python, small-matmul inefficiency): a chunk is split off only where it saves more padding than that
FORWARD_OVERHEAD_TOKENS = 256


def length_chunks(
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    token_budget: int | None = None,
    overhead_tokens: int = FORWARD_OVERHEAD_TOKENS,
) -> list[torch.Tensor]:
    """Split rows into chunks of similar length for separate forward passes, so that little is spent
    on padding: each chunk is trimmed to its longest prompt plus its longest completion.

    Rows are sorted longest completion first and cut into consecutive runs minimising
    ``sum(rows x (longest prompt + longest completion)) + overhead_tokens x chunks`` (dynamic
    programming, exact): equal lengths stay in one forward, a tail of much shorter rows gets its own.
    With ``token_budget`` no chunk of several rows exceeds that many padded tokens.
    Returns row indices ``[n_chunk]`` per chunk, together a permutation of the rows.
    """
    n = completion_mask.size(0)
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    completion_lengths = completion_mask.sum(dim=1).tolist()
    order = sorted(range(n), key=lambda r: (completion_lengths[r], prompt_lengths[r]), reverse=True)
    p = [prompt_lengths[r] for r in order]
    c = [completion_lengths[r] for r in order]  # non-increasing
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    start_of = [0] * (n + 1)  # start_of[j]: where the last chunk of that best split starts
    for j in range(1, n + 1):
        longest_prompt = 0
        for i in range(j - 1, -1, -1):  # the last chunk is rows i .. j-1
            longest_prompt = max(longest_prompt, p[i])
            padded = (j - i) * (longest_prompt + c[i])
            if token_budget is not None and padded > token_budget and j - i > 1:
                break  # wider and longer for every smaller i
            cost = best[i] + padded + overhead_tokens
            if cost < best[j]:
                best[j], start_of[j] = cost, i
    chunks, end = [], n
    while end > 0:
        chunks.append(order[start_of[end] : end])
        end = start_of[end]
    return [torch.tensor(chunk, device=completion_mask.device) for chunk in reversed(chunks)]


def split_chunks(chunks: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``chunks`` (row indices) split further until there are ``count`` of them, the largest chunk
    in halves first (sharded ranks must run the same number of forwards, see
    ``lit_grpo.distributed.agreed_over_sharded_ranks``)."""
    chunks = list(chunks)
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: chunks[i].numel())
        chunk = chunks[largest]
        if chunk.numel() < 2:
            raise ValueError(f"cannot split {sum(c.numel() for c in chunks)} rows into {count} chunks")
        half = (chunk.numel() + 1) // 2
        chunks[largest : largest + 1] = [chunk[:half], chunk[half:]]
    return chunks


def rollout_statistics(scored: ScoredRollout, reward_names: list[str], all_gather) -> dict[str, torch.Tensor]:
    """TRL's metrics of a generation batch over all ranks (``all_gather``: ``LightningModule.all_gather``):
    ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``completions/*`` and ``rewards/<name>/mean|std``;
    and ``prompts/truncated_frac``, the fraction of prompts ``max_prompt_length`` cut.

    ``reward`` and ``reward_std`` are the mean and the Bessel-corrected std of the weighted reward sums
    of every completion of every rank, a completion no reward applies to left out, under either
    ``model.multi_objective_aggregation`` (TRL 1.16's ``nanstd(rewards)``; 0 where fewer than two
    completions have a reward, where TRL logs NaN). ``frac_reward_zero_std`` is the fraction of
    completions whose group carries no signal (:attr:`~lit_grpo.algorithm.GroupAdvantages.zero_std`)."""
    rollout = scored.rollout
    prompt_truncated = rollout.prompt_truncated if rollout.prompt_truncated is not None else torch.zeros_like(rollout.is_truncated)
    per_completion = torch.stack(
        [
            scored.rewards,
            scored.group.zero_std.float(),
            rollout.completion_lengths.float(),
            rollout.is_truncated.float(),
            prompt_truncated.float(),
        ],
        dim=1,
    )  # [N, 5]
    rewards, zero_std, lengths, is_truncated, prompt_cut = gather_rows(per_completion, all_gather).unbind(1)
    rewards_per_func = gather_rows(scored.rewards_per_func, all_gather)  # [world * N, K]
    metrics = {
        "reward": rewards.nanmean(),
        "reward_std": algorithm.nanstd(rewards),  # TRL's: the weighted sums of the whole batch, unscorable rows left out
        "frac_reward_zero_std": zero_std.mean(),
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": is_truncated.mean(),
        # every prompt repeats for its G completions, so the mean over rows is the mean over prompts
        "prompts/truncated_frac": prompt_cut.mean(),
    }
    for k, name in enumerate(reward_names):
        values = rewards_per_func[:, k]
        valid = values[~torch.isnan(values)]
        metrics[f"rewards/{name}/mean"] = valid.mean() if valid.numel() else torch.tensor(float("nan"))
        metrics[f"rewards/{name}/std"] = valid.std() if valid.numel() > 1 else torch.tensor(0.0)
    return metrics
