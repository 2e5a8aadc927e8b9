"""Images through the Engine (the real pipeline, CPU device) on the tiny random Idefics3 folder:
greedy tokens equal transformers' `generate` at depth 1 and 2, for 1 and 3 images, a multi-turn
chat with images, and a prompt chunked through an image; the encoder cache's hits, stats and
Prometheus series; a text-only model refuses images naming the field."""
import asyncio

import pytest
from image_util import picture
import torch

from idefics3_fixture import idefics3_folder  # noqa: F401 (fixture)
from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)



ONE = [picture(100, 150, 0)]
THREE = [picture(100, 150, 1), picture(64, 64, 2), picture(300, 90, 3)]
PROMPT_1 = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"
PROMPT_3 = ("<|im_start|>User:<image>Look<image><end_of_utterance>\nAssistant: ok<end_of_utterance>\n"
            "User: and<image>?<end_of_utterance>\nAssistant:")
CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    {"role": "user", "content": [{"type": "text", "text": "And this"}, {"type": "image"}, {"type": "text", "text": "?"}]},
]


@pytest.fixture(scope="module")
def hf(idefics3_folder):  # noqa: F811
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(idefics3_folder)
    model = AutoModelForImageTextToText.from_pretrained(idefics3_folder, dtype=torch.float32).eval()
    return processor, model


def hf_greedy(hf, text, images, n=8):
    processor, model = hf
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def config(folder, depth, **kw):
    base = dict(model=str(folder), pipeline_depth=depth, max_batch_size=4, max_num_batched_tokens=64,
                kv_cache_tokens=2048, page_size=8, batch_invariant=True, seed=0)
    base.update(kw)
    return EngineConfig(**base)


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_tokens_equal_transformers(idefics3_folder, hf, depth):  # noqa: F811
    chat_text = hf[0].apply_chat_template(CHAT, add_generation_prompt=True)
    want = {"one": hf_greedy(hf, PROMPT_1, ONE), "three": hf_greedy(hf, PROMPT_3, THREE),
            "chat": hf_greedy(hf, chat_text, THREE[:2])}

    async def run():
        async with Engine(config(idefics3_folder, depth)) as engine:
            chat = [dict(m) for m in CHAT]
            chat[0] = {"role": "user", "content": [{"type": "image", "image": THREE[0]},
                                                   {"type": "text", "text": "What is it?"}]}
            chat[2] = {"role": "user", "content": [{"type": "text", "text": "And this"},
                                                   {"type": "image_url", "image_url": {"url": _data_url(THREE[1])}},
                                                   {"type": "text", "text": "?"}]}
            one, three, chatted = await asyncio.gather(
                engine.complete(PROMPT_1, GREEDY, images=ONE), engine.complete(PROMPT_3, GREEDY, images=THREE),
                engine.chat(chat, GREEDY))
            again = await engine.complete(PROMPT_1, GREEDY, images=ONE)  # the encoder cache's hit
            stats = await engine.stats()
            metrics = await engine.metrics_text()
        return one, three, chatted, again, stats, metrics

    one, three, chatted, again, stats, metrics = asyncio.run(run())
    assert one.token_ids == want["one"]
    assert three.token_ids == want["three"]
    assert chatted.token_ids == want["chat"]
    assert again.token_ids == want["one"]
    # 4 distinct pictures (ONE, THREE) encoded once each. The repeat's pages, its image's included, all
    # come from the prefix cache: it takes no entry (issue 37). The chat's second picture is a hit; its
    # first one too, unless PROMPT_3 and the chat (the same text before the same first picture) were
    # admitted one after the other's pages were cached (timing, at depth 2): then it takes no entry
    assert stats["encoder_cache_misses"] == 4 and stats["encoder_cache_hits"] in (1, 2)
    assert stats["encoder_cache_entries"] == 4 and stats["encoder_cache_bytes"] > 0
    assert "slipstream_encoder_cache_hits_total" in metrics and "slipstream_encoder_cache_bytes" in metrics


def _data_url(image):
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("depth", [1, 2])
def test_a_prompt_chunked_through_an_image(idefics3_folder, hf, depth):  # noqa: F811
    """8 tokens a step: the 20 placeholders of the image are fed over several chunks, and the
    encoder budget (4 rows) makes the image's encode the only one in its step."""
    want = hf_greedy(hf, PROMPT_3, THREE)

    async def run():
        async with Engine(config(idefics3_folder, depth, max_num_batched_tokens=8, max_encoder_tokens_per_step=4,
                                 encoder_cache_tokens=8)) as engine:
            return await engine.complete(PROMPT_3, GREEDY, images=THREE)

    assert asyncio.run(run()).token_ids == want


def test_a_text_model_refuses_images_naming_the_field():
    async def run():
        async with Engine(EngineConfig(model="tiny-random", kv_cache_tokens=512)) as engine:
            with pytest.raises(InvalidRequestError) as e:
                await engine.complete("hi", GREEDY, images=ONE)
            assert e.value.param == "images[0]" and str(e.value).startswith("images[0]")
            with pytest.raises(InvalidRequestError) as e:
                await engine.chat([{"role": "user", "content": [{"type": "image", "image": ONE[0]}]}], GREEDY)
            assert e.value.param == "messages[0].content[0].image"

    asyncio.run(run())


def test_skills_take_images(idefics3_folder):  # noqa: F811
    """point/detect/segment look at an image: one marker per image before the instruction, the
    answer still the skill's grammar-constrained text (Idefics3 has no region heads)."""
    async def main():
        async with Engine(config(idefics3_folder, 2)) as engine:
            before = (await engine.stats())["encoder_cache_misses"]
            points = await engine.point("", "cat", max_objects=2, images=ONE)
            detected = [o async for o in engine.stream_skill("detect", "", "cat", max_objects=2, images=ONE)]
            after = await engine.stats()
            return points, detected, after["encoder_cache_misses"] - before, after["encoder_cache_hits"]

    points, detected, misses, hits = asyncio.run(main())
    assert set(points) == {"points"} and all(set(p) == {"x", "y"} for p in points["points"])
    assert all(set(o) == {"x_min", "y_min", "x_max", "y_max"} for o in detected)
    # encoded once: the second skill's pages up to past the image come from the prefix cache
    assert misses == 1 and hits == 0


def test_a_text_model_refuses_a_skills_image():
    async def main():
        async with Engine(EngineConfig(model="tiny-random", kv_cache_tokens=512)) as engine:
            with pytest.raises(InvalidRequestError, match="images"):
                await engine.detect("", "cat", images=ONE)

    asyncio.run(main())


def test_cli_generate_with_an_image_answers_as_engine_chat(idefics3_folder, tmp_path, capsys):  # noqa: F811
    """docs/images.md's one-liner, `slipstream generate --model FOLDER --image PIC "..."`, on the tiny
    folder: it loads, renders the image part with the model's chat template and prints Engine.chat's
    greedy answer."""
    from slipstream.cli import main

    cat = picture(100, 150, 4)  # (a picture whose random answer is not all special tokens: text to compare)
    pic = tmp_path / "cat.png"
    cat.save(pic)
    status = main(["generate", "--model", str(idefics3_folder), "--image", str(pic), "--max-tokens", "8",
                   "--temperature", "0", "Describe the image."])
    printed = capsys.readouterr().out
    assert status == 0

    async def run():
        async with Engine(EngineConfig(model=str(idefics3_folder))) as engine:
            return await engine.chat([{"role": "user", "content": [{"type": "image", "image": cat},
                                                                   {"type": "text", "text": "Describe the image."}]}],
                                     SamplingParams(max_tokens=8, temperature=0.0))

    want = asyncio.run(run())
    assert want.text and printed.startswith(want.text), (printed, want.text)
