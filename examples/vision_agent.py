"""A vision-language user agent written against the `openai` SDK: it looks, then looks closer.

`env.name: agent:examples.vision_agent:look_twice` with a vision-language model and an image task
(`colour`). The prompt's image comes as an OpenAI `image_url` part (a data URL); the agent sends the
prompt as it is, then a user turn with a crop of the image (its non-black part, scaled back to the
image's size, made here with PIL) and the prompt's text again, and returns the final messages: the
run's `task.reward` scores the last answer. Both calls are recorded token in / token out: the crop's
image tokens are the agent's, masked from the loss, and the learner puts the crop's features there.
"""

from __future__ import annotations

import base64
import io


def crop_url(url: str) -> str:
    """A data URL's image cropped to its non-black part and scaled back to its size, as a PNG data URL."""
    from PIL import Image

    data = base64.b64decode(url.partition(",")[2])
    with Image.open(io.BytesIO(data)) as im:
        image = im.convert("RGB")
    box = image.getbbox() or (0, 0, *image.size)
    out = io.BytesIO()
    image.crop(box).resize(image.size).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def look_twice(client, prompt, model):
    messages = list(prompt)
    first = client.chat.completions.create(model=model, messages=messages)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    parts = [p for m in prompt if isinstance(m["content"], list) for p in m["content"]]
    image = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": crop_url(image)}},
                                                 {"type": "text", "text": f"closer look. {text}"}]})
    second = client.chat.completions.create(model=model, messages=messages)
    messages.append({"role": "assistant", "content": second.choices[0].message.content or ""})
    return messages
