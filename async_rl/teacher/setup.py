"""The teacher's replicas as the config says (teacher.model), and the start-up check that the teacher
reads the student's tokens: its log-prob of a token id only means something if the id is the same
token for both."""

from __future__ import annotations

import secrets
from pathlib import Path

from async_rl.cluster.placement import replica_bundle
from async_rl.config import Config
from async_rl.errors import ConfigError
from async_rl.models.tiny import resolve_model_path
from async_rl.reward_models.pool import RewardModelPool
from async_rl.reward_models.setup import replica_engine_spec, replica_host
from async_rl.teacher.server import TeacherServer, TeacherSettings


def teacher_dir(cfg: Config) -> Path:
    return resolve_model_path(cfg.teacher.model, cfg.model.cache_dir)


def check_tokenizers(student_dir: str | Path, teacher_dir: str | Path) -> None:
    """One line (ConfigError) when the teacher's tokenizer maps any token differently from the
    student's: the vocabularies (every token's id) and the special tokens must be the same."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(str(student_dir))
    teacher = AutoTokenizer.from_pretrained(str(teacher_dir))
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])
        token, _ = differ[0]
        raise ConfigError(
            f"teacher.model '{teacher_dir}' has another tokenizer than the student '{student_dir}' "
            f"({len(t_vocab)} vs {len(s_vocab)} tokens; first difference: {token!r} is id {t_vocab.get(token)} "
            f"for the teacher, {s_vocab.get(token)} for the student): distillation needs the same token ids"
        )
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            raise ConfigError(
                f"teacher.model '{teacher_dir}': its {name} is {getattr(teacher, name)}, the student's "
                f"{getattr(student, name)}: distillation needs the same tokenizer"
            )


def teacher_pool(cfg: Config, max_model_len: int, key: str = "") -> RewardModelPool | None:
    """The teacher's replicas (not started), or None without teacher.model. `max_model_len`: the
    engines' (the longest prompt + completion the teacher scores)."""
    t = cfg.teacher
    if not t.model:
        return None
    key = key or secrets.token_urlsafe(32)
    model_dir = str(teacher_dir(cfg))

    def settings(replica_id: int) -> TeacherSettings:
        spec = replica_engine_spec(t, model_dir, max_model_len, replica_id)
        return TeacherSettings(replica_id=replica_id, spec=spec, model_name=t.model, key=key,
                               threads=t.cpus_per_replica, hang_s=t.hang_s, host=replica_host(cfg))

    return RewardModelPool("teacher", TeacherServer, settings, t.replicas, replica_bundle(t, t.tensor_parallel_size))
