"""What a vision-language model takes from the rest of the config, decided before anything starts.

A VLM trains on the torch backend with sdpa attention and without sequence parallelism; its prompts'
images reach neither a teacher nor a KL reference model yet. With LoRA the adapter goes on the language
model alone, so a trained vision tower (learner.freeze_vision=false) is not on offer. Multi-turn
environments (built in or `pkg.module:factory`) and agents (`agent:...`, whose requests may hold
image_url parts) run, and their turns may show images (docs/vision.md); verifiers environments are not
tried with images. Each refusal is one line naming the setting. A text-only model given prompts with
images, or in the `zoom` environment, is refused too. So is a VLM of a family not built
(`vision_family`: Qwen2-VL/Qwen2.5-VL, Qwen3-VL and LLaVA are), and pixel bounds for a family whose processor
resizes every image to one size (LLaVA), and a trained LLaVA tower.
"""

from __future__ import annotations

from async_rl.config import Config
from async_rl.vision_family import family_error, family_of


def vision_error(cfg: Config, vision: bool) -> str | None:
    """The one line that says why this config cannot run its model (a VLM when `vision`), or None."""
    if not vision:
        if cfg.env.name == "zoom":
            return f"env.name=zoom: model.path '{cfg.model.path}' has no vision tower; it shows the model images"
        return None
    path = f"model.path '{cfg.model.path}' is a vision-language model"
    lr = cfg.learner
    if lr.backend != "torch":
        return f"learner.backend={lr.backend}: {path}; they train on the torch backend (learner.backend=torch)"
    if lr.sequence_parallel_size > 1:
        return f"learner.sequence_parallel_size={lr.sequence_parallel_size}: {path}; they train without sequence parallelism (set 1)"
    if lr.attention in ("varlen", "flex"):
        return f"learner.attention={lr.attention}: {path}; they train with sdpa (set sdpa or auto)"
    if lr.lora.enabled and not lr.freeze_vision:
        return (f"learner.freeze_vision=false: {path}; with learner.lora its language model's adapter alone trains "
                "(the vision tower and its projector stay as loaded): set learner.freeze_vision=true")
    if cfg.teacher.model:
        return f"teacher.model: {path}; the teacher would score its prompts without their images"
    if cfg.env.name.startswith("verifiers:"):
        return f"env.name={cfg.env.name}: {path}; verifiers environments with images are not tried yet"
    if cfg.algorithm.kl_coef > 0:
        return f"algorithm.kl_coef={cfg.algorithm.kl_coef}: {path}; the KL reference would score its prompts without their images"
    return None


def family_settings_error(cfg: Config, kind: str) -> str | None:
    """A vision-language model of model_type `kind`: the one line that refuses a family not built, or
    pixel bounds that its processor does not take (LLaVA resizes every image to one size), or None."""
    family = family_of(kind)
    if family is None:
        return family_error(kind, cfg.model.path)
    if not family.pixel_bounds and (cfg.vision.min_pixels or cfg.vision.max_pixels):
        return (f"vision.min_pixels/max_pixels: model.path '{cfg.model.path}' is a {family.name} model, whose processor "
                "resizes every image to one fixed size: leave them 0")
    if not family.tower_trains and not cfg.learner.freeze_vision:
        return (f"learner.freeze_vision=false: model.path '{cfg.model.path}' is a {family.name} model, whose vision "
                "tower's weights the learner cannot send to vLLM under its names yet: set it true")
    return None


def images_error(cfg: Config, vision: bool, first_has_images: bool) -> str | None:
    """A text-only model whose task gives prompts with images: one line, or None."""
    if first_has_images and not vision:
        return (
            f"task.name '{cfg.task.name}' gives prompts with images, but model.path '{cfg.model.path}' has no "
            "vision tower: use a vision-language model"
        )
    return None
