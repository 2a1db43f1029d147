"""A vision-language run's untrained groups keep their images across a buffer snapshot (a restarted
buffer) and a checkpoint (a resume): the prompt's images and each sample's own (an environment turn's
crop), byte for byte, and none counted lost."""

from __future__ import annotations

import asyncio
import io

from PIL import Image

from async_rl.control import checkpoint
from tests.unit.test_elastic_units import deliver, group, make_buffer


def png(colour: tuple[int, int, int], size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def seen(pid: int):
    """Group `pid`: one prompt image; its second sample was shown a crop by the environment."""
    g = group(pid, 0)
    g.images = [png((pid * 40, 0, 0))]
    g.sample_images = [[], [png((0, pid * 40, 0), size=4)]]
    return g


def images(g) -> list[list[bytes]]:
    return [g.images_of(i) for i in range(len(g.completions))]


def test_a_restarted_buffer_keeps_the_images_of_untrained_groups(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        for pid in (0, 1, 2):
            deliver(buf, seen(pid))
        await buf.server.build(step=0, world_size=1)  # groups 0, 1 built into a batch; 2 waits
        buf.save_snapshot()

    asyncio.run(scenario())
    new = make_buffer(tmp_path, restore=True)
    kept = [*new.server.built()[0][0], *new.server.waiting()]
    assert [g.prompt_id for g in kept] == [0, 1, 2]
    assert all(images(g) == images(seen(g.prompt_id)) for g in kept)
    assert new.ledger.accounts.lost == 0


def test_a_resume_keeps_the_images_of_untrained_groups(tmp_path):
    async def scenario():
        old = make_buffer(tmp_path)
        await old.lease(engine_id=0, max_groups=2, wait_s=0)
        for pid in (0, 1):
            deliver(old, seen(pid))
        tmp = checkpoint.begin(tmp_path / "run")
        state = checkpoint.RunCheckpoint(step=0, version=0, buffer=old.checkpoint_state(), saved_at=0.0)
        final = checkpoint.commit(tmp, state, keep=2)
        new = make_buffer(tmp_path / "resumed")
        await new.restore(checkpoint.load_state(final).buffer)
        return new

    (tmp_path / "resumed").mkdir()
    new = asyncio.run(scenario())
    waiting = new.server.waiting()
    assert [g.prompt_id for g in waiting] == [0, 1]
    assert all(images(g) == images(seen(g.prompt_id)) for g in waiting)
    assert new.ledger.accounts.balanced() and new.ledger.accounts.lost == 0
