"""Wire types shared by generator, buffer and learner.

A trajectory message is a ZMQ multipart frame of three parts, with up to two optional ones after them
(teacher log-probs, then MoE routes; the header says which are there):

  [0] msgpack header (`GroupsHeader`): schema version, run id, and per group/sample metadata
  [1] int32 little-endian token ids: for each group its prompt tokens, then each completion's tokens
  [2] float32 little-endian behaviour log-probs: one per completion token, in the same order
  [3] (only when a sample of the frame was scored by a teacher, `SampleMeta.teacher_scored`) float32
      little-endian teacher log-probs: one per completion token of each scored sample, in the same order
      (0.0 on a multi-turn episode's environment tokens, which no teacher scores)
  [3 or 4, the last] only when the header has a `routes` layout: each routed sample's routes (see
      ROUTE_DTYPES), in sample order, as raw little-endian uint8/uint16 [rows, layers, top_k] arrays back to back; the
      header's layout gives layers, top_k and the item size, the rows follow from the sample's lengths

A vision-language group carries its prompt's images in the header (`GroupMeta.images`: the encoded
files, once per group, not per sample; processed pixels would be 10-100x larger, see docs/vision.md).
A multi-turn episode whose environment showed the model images (a tool's crop) carries those in its
sample (`SampleMeta.images`, in the order of their placeholders in its completion).

A multi-turn episode's completion holds the model's turns and the environment's turns (tool results,
feedback) in order; its sample carries a loss mask (1 byte per completion token: 1 the model's, 0 the
environment's; log-prob 0.0 there) in the header. No mask: every completion token is the model's.
An agent episode split at prefix breaks (docs/agents.md) is several samples of its group, one per
segment, each naming its episode (`episode_index`): the group's statistics count episodes.

Token ids and log-probs never travel as lists of Python numbers. The same framing carries groups
from generators to the buffer and batches from the buffer to learner ranks. A frame that fails any
check raises `FrameError` with a short reason that the receiver counts.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

# 2: finish reason per sample; 3: multi-turn episodes (loss mask, turns, tool counts); 4: a sample may be
# one segment of an episode (`episode_index`); 5: teacher log-probs (on-policy distillation: part [3]);
# 6: MoE routes (the header's `routes` layout, a group's `routed` flag, the last part); 7: a group's images;
# 8: a sample's own images (an episode's environment turns)
SCHEMA_VERSION = 8

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")

# An MoE sample's routes (rollout routing replay): the experts each MoE layer chose for each token the
# engine ran forward, as an unsigned integer array [tokens, moe_layers, top_k] (uint8 up to 255
# experts, uint16 above: vLLM's own choice). Rows: prompt_len + completion_len - 1 (the last sampled
# token never runs forward; the learner's forward over it affects no scored position, so the live
# router takes it). Layers: the model's MoE layers in order (dense layers have no row). A row whose
# entries are all ROUTE_MISSING (the dtype's maximum) has no recorded route: the learner's live router
# takes that token, and counts it.
ROUTE_DTYPES = (np.dtype("<u1"), np.dtype("<u2"))


def route_missing(dtype: np.dtype) -> int:
    """The 'no route recorded' value of a routes dtype: its maximum."""
    return int(np.iinfo(dtype).max)


def route_dtype(num_experts: int) -> np.dtype:
    """The routes dtype of a model with `num_experts` experts (one value kept for ROUTE_MISSING)."""
    return ROUTE_DTYPES[0] if num_experts < 255 else ROUTE_DTYPES[1]


def route_rows(prompt_len: int, completion_len: int) -> int:
    """Rows of a sample's routes: every token but the last ran forward in the engine."""
    return max(prompt_len + completion_len - 1, 0)


class RouteLayout(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The shape of every routes array of a frame (one model): MoE layers, experts per token, bytes per entry."""

    layers: int
    top_k: int
    itemsize: int  # 1 (uint8) or 2 (uint16), see ROUTE_DTYPES

    @property
    def dtype(self) -> np.dtype:
        return ROUTE_DTYPES[0] if self.itemsize == 1 else ROUTE_DTYPES[1]

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * self.itemsize


# Outcome of the reward call of one sample; carried on the wire so the buffer can count it.
REWARD_OK = 0
REWARD_ERROR = 1
REWARD_TIMEOUT = 2
REWARD_CRASH = 3  # the reward's worker process died mid-call (a crash, a signal)
REWARD_STATUSES = (REWARD_OK, REWARD_ERROR, REWARD_TIMEOUT, REWARD_CRASH)

# Why a completion ended; carried per sample (overlong handling, truncation metrics).
FINISH_STOP = 0  # EOS, a stop token or a stop string
FINISH_LENGTH = 1  # cut at max_tokens (or the model's length limit)
FINISH_ABORT = 2  # cut by an abort-mode pause and not resumed
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


class EpisodeInfo(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Counts of one multi-turn episode (metrics: turns, tool use)."""

    turns: int = 1  # model turns
    tool_calls: int = 0  # well-formed calls of known tools
    tool_errors: int = 0  # malformed calls, unknown tools, failed tools
    tool_timeouts: int = 0  # tool calls killed at their time limit (the sandbox)
    tool_ok: int = 0  # tool calls that ran and returned a result (every other attempt is a tool error)
    turn_versions: list[int] = []  # the policy version each model turn started on, turn by turn


class SampleMeta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    completion_len: int
    reward: float
    # the lowest and highest policy versions its tokens were generated with: in time order as a rule, but
    # a learner recovery brings an older checkpoint's weights back, so a later token may have the lower
    version_first: int
    version_last: int
    reward_status: int = REWARD_OK
    finish_reason: int = FINISH_STOP
    loss_mask: bytes | None = None  # per completion token 0/1 (None: every token is the model's)
    episode: EpisodeInfo | None = None  # multi-turn episodes only
    # The group's episode this sample is a segment of (an agent episode split at prefix breaks);
    # None: the sample is its own episode. Within a group: all None, or 0, 1, ... in order.
    episode_index: int | None = None
    # whether frame part [3] holds this sample's teacher log-probs (a teacher scored its tokens)
    teacher_scored: bool = False
    # Images the sample's own tokens hold beyond its group's prompt images (encoded files): an episode's
    # environment turns (a tool's crop), or an agent's calls; in the order of their placeholders, which
    # lie in environment tokens (loss mask 0) or, for images not in the group's prompt, in the prompt
    images: list[bytes] = []


class GroupMeta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    prompt_id: int
    engine_id: int
    prompt_len: int
    samples: list[SampleMeta]
    routed: bool = False  # every sample's routes are in the frame's fourth part (see RouteLayout)
    # The prompt's images as the engine read them (encoded files: PNG, JPEG, ...), in prompt order: the
    # learner processes these bytes with the same processor settings, so it trains on the engine's pixels
    images: list[bytes] = []


class GroupsHeader(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    run_id: str
    groups: list[GroupMeta]
    step: int = -1  # the optimizer step a batch is for (-1 on generator -> buffer frames)
    routes: RouteLayout | None = None  # set when a group of the frame carries routes (the fourth part)


# the attention path whose cost the learner's micro-batches follow (`models/cost.py`)
AttentionPath = Literal["flash", "dense", "segments"]


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Learner rank -> buffer: send me my shard of the batch for `step`. The learner's cost model
    (`models/cost.CostModel`: the model's attention weight, the attention path its kernel runs, the
    packed rows' width) comes with it: the step's first request deals the ranks by it."""

    schema: int
    run_id: str
    step: int
    rank: int
    world_size: int
    attention_weight: float = 0.0
    attention_path: AttentionPath = "flash"
    row_tokens: int = 0


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # 'system' | 'user' | 'assistant' | 'tool'
    content: str


# Free per-row metadata of a dataset (verl-style extra columns), kept with the prompt for rewards.
MetaValue = str | int | float | bool | None


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt leased to an engine.

    A task or dataset gives `text` (a plain prompt) or `messages` (a chat); the prompt source in the
    buffer renders it once with the model's chat template into `token_ids`, which is what vLLM
    generates from and what the learner trains on (no re-tokenization anywhere on the path).
    `answer` is what the reward function checks against."""

    prompt_id: int
    text: str = ""
    answer: str = ""
    messages: list[ChatMessage] = []
    token_ids: list[int] = []  # the rendered prompt; empty until the prompt source renders it
    data_source: str = ""  # task or dataset name: eval metrics are reported per data source
    metadata: dict[str, MetaValue] = {}
    # Images of a vision-language prompt, encoded files (PNG, JPEG, ...), in the order of the prompt's
    # `<image>` markers (none: before the text). `token_ids` then hold every image's placeholder tokens
    # expanded by the model's processor (images.py, chat.py).
    images: list[bytes] = []


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """What a reward function receives: one finished completion of `prompt`."""

    prompt: Prompt
    completion: str  # decoded completion text
    completion_ids: list[int] = []
    finish_reason: str = "stop"  # 'stop' | 'length' | 'abort'


class FrameError(ValueError):
    """A frame failed validation; `reason` is the counter it lands in."""

    def __init__(self, reason: str, detail: str = "", header: GroupsHeader | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.header = header  # set when the header itself decoded (the frame names its prompts)


@dataclass(slots=True)
class TrajectoryGroup:
    """In-memory form of one prompt group: every completion of one prompt, with its log-probs."""

    prompt_id: int
    engine_id: int
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    completions: list[np.ndarray]  # int32 [completion_len] each
    logprobs: list[np.ndarray]  # float32 [completion_len] each, behaviour policy
    rewards: list[float]
    version_first: list[int]
    version_last: list[int]
    reward_status: list[int]
    finish_reasons: list[int] | None = None  # FINISH_* per sample (None: all FINISH_STOP)
    # uint8 0/1 per completion token (1 = the model's), per sample; None (all or one): all the model's
    loss_masks: list[np.ndarray | None] | None = None
    episodes: list[EpisodeInfo] | None = None  # multi-turn episodes: per sample counts
    # Per sample, the episode it is a segment of: 0, 1, ... non-decreasing, consecutive samples of an
    # episode (an agent episode split at prefix breaks trains each segment as a sample, all with the
    # episode's reward). None: sample i is episode i. Accounting and group advantages count episodes.
    episode_of: list[int] | None = None
    # MoE models with routing capture: per sample its routes (see ROUTE_DTYPES above for the shape and
    # the rows); None: no routes recorded (a dense model, or capture off)
    routes: list[np.ndarray] | None = None
    # On-policy distillation: per sample the teacher's log-prob of each completion token (float32
    # [completion_len], 0.0 on environment tokens), or None where no teacher scored it; None: none was
    teacher_logprobs: list[np.ndarray | None] | None = None
    # A vision-language prompt's images (encoded files), as on `Prompt.images`; None: a text prompt
    images: list[bytes] | None = None
    # Per sample, the images its own tokens hold after the group's (`SampleMeta.images`); None: none has any
    sample_images: list[list[bytes]] | None = None

    def images_of(self, i: int) -> list[bytes]:
        """Every image sample i's tokens hold, in the order of their placeholders: the group's, then its own."""
        own = self.sample_images[i] if self.sample_images is not None else []
        return list(self.images or ()) + list(own)

    def teacher_logprob(self, i: int) -> np.ndarray | None:
        """Sample i's teacher log-probs, or None when no teacher scored it."""
        return self.teacher_logprobs[i] if self.teacher_logprobs is not None else None

    def loss_mask(self, i: int) -> np.ndarray:
        """Sample i's loss mask as uint8 0/1 (all 1 without one)."""
        m = self.loss_masks[i] if self.loss_masks is not None else None
        return np.ones(len(self.completions[i]), np.uint8) if m is None else np.asarray(m, np.uint8)

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def oldest_version(self) -> int:
        return min(self.version_first)

    @property
    def episode_count(self) -> int:
        """The group's episodes: what leases, accounting and the group's advantage statistics count."""
        return self.episode_of[-1] + 1 if self.episode_of else self.size

    def episode_index(self) -> list[int]:
        """Per sample, its episode (sample i is episode i unless episodes were split)."""
        return list(self.episode_of) if self.episode_of is not None else list(range(self.size))

    def episode_last_samples(self) -> list[int]:
        """Per episode, its last sample (the segment holding the episode's last call, its answer)."""
        if self.episode_of is None:
            return list(range(self.size))
        of = self.episode_of
        return [i for i in range(len(of)) if i + 1 == len(of) or of[i + 1] != of[i]]


def _mask_bytes(mask: np.ndarray | None) -> bytes | None:
    return None if mask is None else np.asarray(mask, dtype=np.uint8).tobytes()


def episode_versions(turn_versions: list[int], ended_on: int) -> tuple[int, int]:
    """(version_first, version_last) of a sample whose model turns started on `turn_versions` (one at
    least) and whose last turn ended on `ended_on`: the lowest and the highest of them, what
    `_check_episode` holds a frame to (after a learner recovery a later turn may run on a lower version)."""
    return min(turn_versions), max(ended_on, *turn_versions)


def _check_episode(s: SampleMeta, prompt_id: int) -> None:
    """Per-turn versions agree with the sample's: one per model turn, the lowest is `version_first` (the
    buffer's staleness rule reads that), none after `version_last`. Not necessarily in order: a learner
    recovery syncs an older checkpoint's weights, so a later turn may run on a lower version."""
    ep = s.episode
    if ep is None or not ep.turn_versions:
        return
    v = ep.turn_versions
    if len(v) != ep.turns or min(v) != s.version_first or max(v) > s.version_last:
        raise FrameError(
            "bad_episode",
            f"prompt {prompt_id}: turn versions {v} do not fit {ep.turns} turns between versions "
            f"{s.version_first} and {s.version_last}",
        )


def _check_episode_index(samples: list[SampleMeta], prompt_id: int) -> list[int] | None:
    """The group's episode per sample, checked: none, or 0 first and each next the same or one more
    (an episode's segments are consecutive), the segments of an episode with one reward and status."""
    index = [s.episode_index for s in samples]
    if all(i is None for i in index):
        return None
    ok = index[0] == 0 and all(
        b is not None and (b == a or (b == a + 1)) for a, b in zip(index, index[1:], strict=False)
    )
    ok = ok and all(
        b.episode_index != a.episode_index or (a.reward == b.reward and a.reward_status == b.reward_status)
        for a, b in zip(samples, samples[1:], strict=False)
    )
    if not ok:
        raise FrameError(
            "bad_episode", f"prompt {prompt_id}: episode indices {index} are not 0, 1, ... in order with one "
            "reward per episode",
        )
    return [i for i in index if i is not None]  # all set, checked above


def _decode_mask(s: SampleMeta, prompt_id: int) -> np.ndarray | None:
    """The sample's loss mask, checked: one 0/1 per completion token, at least one model token."""
    if s.loss_mask is None:
        return None
    mask = np.frombuffer(s.loss_mask, dtype=np.uint8)
    if len(mask) != s.completion_len:
        raise FrameError("bad_mask", f"prompt {prompt_id}: loss mask of {len(mask)} for {s.completion_len} tokens")
    if mask.size and int(mask.max()) > 1:
        raise FrameError("bad_mask", f"prompt {prompt_id}: loss mask values must be 0 or 1")
    if s.completion_len and not mask.any():
        raise FrameError("bad_mask", f"prompt {prompt_id}: loss mask has no model token")
    return mask


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(GroupsHeader)
_request_decoder = msgspec.msgpack.Decoder(BatchRequest)


def _routes_layout(groups: list[TrajectoryGroup]) -> RouteLayout | None:
    """The one layout of the frame's routes (None: no group has routes). A routes array that does not
    fit the contract is a bug of its producer: ValueError naming the prompt."""
    layout = None
    for g in groups:
        for i, r in enumerate(g.routes or ()):
            rows = route_rows(len(g.prompt_tokens), len(g.completions[i]))
            here = RouteLayout(r.shape[1], r.shape[2], r.dtype.itemsize) if r.ndim == 3 else None
            if here is None or r.dtype.newbyteorder("<") not in ROUTE_DTYPES or r.shape[0] != rows:
                raise ValueError(
                    f"prompt {g.prompt_id} sample {i}: routes {r.dtype} {r.shape}, want uint8/uint16 [{rows}, layers, top_k]"
                )
            if layout is not None and here != layout:
                raise ValueError(f"prompt {g.prompt_id}: routes of layout {here} beside {layout} in one frame")
            layout = here
    return layout


def encode_groups(run_id: str, groups: list[TrajectoryGroup], step: int = -1) -> list[bytes]:
    metas = []
    token_parts: list[np.ndarray] = []
    logprob_parts: list[np.ndarray] = []
    teacher_parts: list[np.ndarray] = []
    layout = _routes_layout(groups)
    route_parts: list[bytes] = []
    for g in groups:
        samples = []
        token_parts.append(np.asarray(g.prompt_tokens, dtype=TOKEN_DTYPE))
        for i, comp in enumerate(g.completions):
            token_parts.append(np.asarray(comp, dtype=TOKEN_DTYPE))
            logprob_parts.append(np.asarray(g.logprobs[i], dtype=LOGPROB_DTYPE))
            teacher = g.teacher_logprob(i)
            if teacher is not None:
                teacher_parts.append(np.asarray(teacher, dtype=LOGPROB_DTYPE))
            samples.append(
                SampleMeta(
                    completion_len=len(comp),
                    reward=float(g.rewards[i]),
                    version_first=int(g.version_first[i]),
                    version_last=int(g.version_last[i]),
                    reward_status=int(g.reward_status[i]),
                    finish_reason=int(g.finish_reasons[i]) if g.finish_reasons is not None else FINISH_STOP,
                    loss_mask=_mask_bytes(g.loss_masks[i]) if g.loss_masks is not None else None,
                    episode=g.episodes[i] if g.episodes is not None else None,
                    episode_index=g.episode_of[i] if g.episode_of is not None else None,
                    teacher_scored=teacher is not None,
                    images=list(g.sample_images[i]) if g.sample_images is not None else [],
                )
            )
        if g.routes is not None and layout is not None:
            route_parts.extend(np.ascontiguousarray(r, dtype=layout.dtype).tobytes() for r in g.routes)
        metas.append(
            GroupMeta(g.prompt_id, g.engine_id, len(g.prompt_tokens), samples, g.routes is not None, list(g.images or ()))
        )
    header = GroupsHeader(schema=SCHEMA_VERSION, run_id=run_id, groups=metas, step=step, routes=layout)
    tokens = np.concatenate(token_parts) if token_parts else np.empty(0, TOKEN_DTYPE)
    logprobs = np.concatenate(logprob_parts) if logprob_parts else np.empty(0, LOGPROB_DTYPE)
    frames = [_header_encoder.encode(header), tokens.tobytes(), logprobs.tobytes()]
    if teacher_parts:
        frames.append(np.concatenate(teacher_parts).tobytes())
    if layout is not None:
        frames.append(b"".join(route_parts))
    return frames


def decode_groups(frames: list[bytes], run_id: str, max_bytes: int = 1 << 30) -> tuple[GroupsHeader, list[TrajectoryGroup]]:
    """Decode and validate a groups frame; raises FrameError(reason) on anything malformed."""
    if len(frames) not in (3, 4, 5):
        raise FrameError("frame_count", f"expected 3 to 5 parts, got {len(frames)}")
    if len(frames[0]) > max_bytes:
        raise FrameError("too_large", f"header of {len(frames[0])} bytes > {max_bytes}")
    try:
        header = _header_decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise FrameError("bad_header", str(exc)) from None
    if header.schema != SCHEMA_VERSION:
        raise FrameError("schema_version", f"got {header.schema}, want {SCHEMA_VERSION}")
    if header.run_id != run_id:
        raise FrameError("run_id", f"frame of run '{header.run_id}'")
    want = 3 + _teacher_scored(header) + (header.routes is not None)  # [teacher log-probs], [routes]
    if len(frames) != want:
        raise FrameError(
            "frame_count", f"{len(frames)} parts for a header that announces {want} (teacher log-probs: "
            f"{'yes' if _teacher_scored(header) else 'no'}, routes: {'yes' if header.routes else 'no'})",
        )
    try:
        return header, _decode_body(header, frames, max_bytes)
    except FrameError as exc:
        exc.header = header  # the receiver may release the prompts this frame names
        raise


def _decode_body(header: GroupsHeader, frames: list[bytes], max_bytes: int) -> list[TrajectoryGroup]:
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise FrameError("too_large", f"{total} bytes > {max_bytes}")
    if len(frames[1]) % TOKEN_DTYPE.itemsize or len(frames[2]) % LOGPROB_DTYPE.itemsize:
        raise FrameError("buffer_size", "token or log-prob buffer is not a whole number of items")
    tokens = np.frombuffer(frames[1], dtype=TOKEN_DTYPE)
    logprobs = np.frombuffer(frames[2], dtype=LOGPROB_DTYPE)
    want_tokens = sum(g.prompt_len + sum(s.completion_len for s in g.samples) for g in header.groups)
    want_logprobs = sum(s.completion_len for g in header.groups for s in g.samples)
    if want_tokens != len(tokens) or want_logprobs != len(logprobs):
        raise FrameError(
            "length_mismatch",
            f"header says {want_tokens} tokens/{want_logprobs} logprobs, got {len(tokens)}/{len(logprobs)}",
        )
    teacher = _decode_teacher_part(header, frames)
    groups: list[TrajectoryGroup] = []
    if header.routes is None and any(g.routed for g in header.groups):
        raise FrameError("bad_routes", "a routed group in a frame without a routes layout")
    routes = _decode_routes(header, frames[-1]) if header.routes is not None else None
    t = 0
    lp = 0
    tp = 0
    for g in header.groups:
        if g.prompt_len < 0 or not g.samples or any(s.completion_len < 0 for s in g.samples):
            raise FrameError("bad_value", f"prompt {g.prompt_id}: negative length or empty group")
        for s in g.samples:
            if (
                not math.isfinite(s.reward)
                or s.version_first < 0
                or s.version_last < s.version_first
                or s.reward_status not in REWARD_STATUSES
            ):
                raise FrameError("bad_value", f"prompt {g.prompt_id}: reward or versions out of range")
            if s.finish_reason not in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT):
                raise FrameError("bad_value", f"prompt {g.prompt_id}: finish reason {s.finish_reason} out of range")
        _check_images(g)
        prompt = tokens[t : t + g.prompt_len]
        t += g.prompt_len
        comps, lps, teachers = [], [], []
        masks = [_decode_mask(s, g.prompt_id) for s in g.samples]
        for s in g.samples:
            _check_episode(s, g.prompt_id)
        episode_of = _check_episode_index(g.samples, g.prompt_id)
        for s in g.samples:
            comps.append(tokens[t : t + s.completion_len])
            lps.append(logprobs[lp : lp + s.completion_len])
            teachers.append(teacher[tp : tp + s.completion_len] if s.teacher_scored else None)
            t += s.completion_len
            lp += s.completion_len
            tp += s.completion_len if s.teacher_scored else 0
        groups.append(
            TrajectoryGroup(
                prompt_id=g.prompt_id,
                engine_id=g.engine_id,
                prompt_tokens=prompt,
                completions=comps,
                logprobs=lps,
                rewards=[s.reward for s in g.samples],
                version_first=[s.version_first for s in g.samples],
                version_last=[s.version_last for s in g.samples],
                reward_status=[s.reward_status for s in g.samples],
                finish_reasons=[s.finish_reason for s in g.samples],
                loss_masks=masks if any(m is not None for m in masks) else None,
                episodes=[s.episode or EpisodeInfo() for s in g.samples]
                if any(s.episode is not None for s in g.samples)
                else None,
                episode_of=episode_of,
                teacher_logprobs=teachers if any(x is not None for x in teachers) else None,
                routes=[next(routes) for _ in g.samples] if g.routed and routes is not None else None,
                images=list(g.images) if g.images else None,
                sample_images=[list(s.images) for s in g.samples] if any(s.images for s in g.samples) else None,
            )
        )
    if tokens.size and int(tokens.min()) < 0:
        raise FrameError("bad_value", "negative token id")
    # ndarray methods, not np.all(...): the module-level wrapper cost more than the check on small frames.
    if logprobs.size and not bool((np.isfinite(logprobs) & (logprobs <= 1e-3)).all()):
        # A log-probability is finite and never positive (1e-3 allows float rounding).
        raise FrameError("bad_value", "log-probs must be finite and <= 0")
    return groups


def _check_images(g: GroupMeta) -> None:
    """A group's images (and its samples' own) are files an image library can open (their header read,
    not the pixels): one that cannot be is the counted reason `bad_image`, never a group the learner fails on."""
    every = list(g.images) + [data for s in g.samples for data in s.images]
    if not every:
        return
    from PIL import Image, UnidentifiedImageError

    for i, data in enumerate(every):
        try:
            with Image.open(io.BytesIO(data)) as im:
                im.size  # noqa: B018 (reading the header is the check)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise FrameError("bad_image", f"prompt {g.prompt_id}: image {i} ({len(data)} bytes) is not a readable image") from None


def _teacher_scored(header: GroupsHeader) -> bool:
    """Whether the frame carries the teacher log-probs part (some sample is marked scored)."""
    return any(s.teacher_scored for g in header.groups for s in g.samples)


def _decode_teacher_part(header: GroupsHeader, frames: list[bytes]) -> np.ndarray:
    """Part [3], the teacher log-probs of the samples the header marks scored, checked: present exactly
    when some sample is scored, one per completion token of each, finite and never positive."""
    want = sum(s.completion_len for g in header.groups for s in g.samples if s.teacher_scored)
    if not _teacher_scored(header):  # decode_groups checked the part count against the header
        return np.empty(0, LOGPROB_DTYPE)
    if len(frames[3]) % LOGPROB_DTYPE.itemsize:
        raise FrameError("buffer_size", "teacher log-prob buffer is not a whole number of items")
    teacher = np.frombuffer(frames[3], dtype=LOGPROB_DTYPE)
    if len(teacher) != want:
        raise FrameError("length_mismatch", f"header says {want} teacher log-probs, got {len(teacher)}")
    if teacher.size and not bool((np.isfinite(teacher) & (teacher <= 1e-3)).all()):
        raise FrameError("bad_value", "teacher log-probs must be finite and <= 0")
    return teacher


def _decode_routes(header: GroupsHeader, raw: bytes) -> Iterator[np.ndarray]:
    """Every routed sample's routes in frame order, checked as a whole: the layout, the byte count the
    lengths imply, each row all recorded or all ROUTE_MISSING, no expert twice in one layer's top-k.
    Any failure is the counted reason `bad_routes`."""
    layout = header.routes
    assert layout is not None
    if layout.layers < 1 or layout.top_k < 1 or layout.itemsize not in (1, 2):
        raise FrameError("bad_routes", f"routes layout {layout}: layers and top_k >= 1, item size 1 or 2")
    routed = [g for g in header.groups if g.routed]
    if not routed:
        raise FrameError("bad_routes", "a routes layout but no routed group")
    rows = [route_rows(g.prompt_len, s.completion_len) for g in routed for s in g.samples]
    per_row = layout.layers * layout.top_k
    if len(raw) != sum(rows) * per_row * layout.itemsize:
        raise FrameError(
            "bad_routes", f"routes part of {len(raw)} bytes, the lengths say {sum(rows)} rows x {per_row} x {layout.itemsize}"
        )
    flat = np.frombuffer(raw, dtype=layout.dtype).reshape(sum(rows), layout.layers, layout.top_k)
    missing = route_missing(layout.dtype)
    absent = (flat == missing).reshape(len(flat), per_row)
    if bool((absent.any(axis=1) != absent.all(axis=1)).any()):
        raise FrameError("bad_routes", f"prompt {_row_prompt(routed, rows, absent)}: a routes row mixes recorded and missing experts")
    # Pairwise over the top-k (k(k-1)/2 vectorised compares): half the time of a sort along a short axis.
    for a in range(layout.top_k):
        for b in range(a + 1, layout.top_k):
            if bool(((flat[..., a] == flat[..., b]) & (flat[..., a] != missing)).any()):
                raise FrameError("bad_routes", "a routes row names one expert twice in a layer's top-k")
    return iter(np.split(flat, np.cumsum(rows)[:-1]))


def _row_prompt(routed: list[GroupMeta], rows: list[int], absent: np.ndarray) -> int:
    """The prompt of the first row that mixes recorded and missing entries (for the error line)."""
    bad = int(np.argmax(absent.any(axis=1) != absent.all(axis=1)))
    ends = np.cumsum(rows)
    sample = int(np.searchsorted(ends, bad, side="right"))
    owners = [g.prompt_id for g in routed for _ in g.samples]
    return owners[sample]


def encode_request(req: BatchRequest) -> bytes:
    return _header_encoder.encode(req)


def decode_request(frame: bytes, run_id: str) -> BatchRequest:
    try:
        req = _request_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise FrameError("bad_request", str(exc)) from None
    if req.schema != SCHEMA_VERSION:
        raise FrameError("schema_version", f"got {req.schema}")
    if req.run_id != run_id:
        raise FrameError("run_id", f"request of run '{req.run_id}'")
    if req.world_size < 1 or not 0 <= req.rank < req.world_size or req.step < 0:
        raise FrameError("bad_request", f"rank {req.rank} of world {req.world_size}, step {req.step}")
    return req
