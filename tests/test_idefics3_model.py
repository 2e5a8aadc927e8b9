"""Idefics3 (SmolVLM) against transformers on the tiny random folder of tests/idefics3_fixture.py:
the processor's tiles and expanded ids, the vision tower + connector, and the decoder fed the image
embeddings through ForwardBatch.embed_rows/embeds (full-prompt logits, a prefill chunked through an
image, greedy tokens, the CPU packed path)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from host_batch import Chunk, host_batch
from idefics3_fixture import IMAGE_SEQ_LEN, idefics3_folder  # noqa: F401 (a pytest fixture)
from slipstream.errors import CorruptModelError, InvalidRequestError
from slipstream.models.loading.build import build_model
from slipstream.models.idefics3.processor import Idefics3Processing
from slipstream.models.base import KVCache

pytest.importorskip("transformers")
PAGE = 4


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rs = np.random.RandomState(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rs.randint(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


ONE = [picture(100, 150, 0)]
THREE = [picture(100, 150, 1), picture(64, 64, 2), picture(300, 90, 3)]
MODES = [picture(50, 40, 4, "RGBA"), picture(130, 70, 5, "L")]
PROMPT_1 = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"
PROMPT_3 = ("<|im_start|>User:<image>Look<image><end_of_utterance>\nAssistant: ok<end_of_utterance>\n"
            "User: and<image>?<end_of_utterance>\nAssistant:")


@pytest.fixture(scope="module")
def hf(idefics3_folder):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(idefics3_folder)
    model = AutoModelForImageTextToText.from_pretrained(idefics3_folder, dtype=torch.float32).eval()
    return processor, model


@pytest.fixture(scope="module")
def ours(idefics3_folder):
    model, tokenizer, config = build_model(str(idefics3_folder), "float32", torch.device("cpu"))
    return model, tokenizer, config


def hf_inputs(processor, text, images, **kwargs):
    return processor(text=text, images=images, return_tensors="pt", **kwargs)


@pytest.mark.parametrize("images,text,split", [
    (ONE, PROMPT_1, True),
    (THREE, PROMPT_3, True),
    (THREE, PROMPT_3, False),
    (MODES, "<image>x<image>", True),
], ids=["one", "three", "three-unsplit", "rgba-and-gray"])
def test_processor_matches_transformers(hf, ours, images, text, split):
    processor, _ = hf
    model, tokenizer, _ = ours
    processing = model.vision.processing
    if not split:
        processing = Idefics3Processing(dataclasses.replace(processing.config, do_image_splitting=False),
                                        processing.tokens_per_tile)
    want = hf_inputs(processor, text, images, do_image_splitting=split)
    got = processing.preprocess(images)
    assert torch.equal(torch.cat([g.pixel_values for g in got]), want["pixel_values"][0])
    assert torch.equal(torch.cat([g.pixel_attention_mask for g in got]), want["pixel_attention_mask"][0].bool())
    ids = tokenizer.encode(processing.expand(text, got))
    assert ids == want["input_ids"][0].tolist()
    assert sum(g.num_image_tokens for g in got) == ids.count(model.config.image_token_id)
    if split:  # the example: a 100x150 image is 2x2 tiles + the global view
        assert (got[0].rows, got[0].cols, got[0].num_tiles) == (2, 2, 5)
        assert got[0].num_image_tokens == 5 * IMAGE_SEQ_LEN


def test_expand_refuses_a_marker_count_that_differs_from_the_images(ours):
    processing = ours[0].vision.processing
    with pytest.raises(InvalidRequestError, match="2 <image> markers for 1 images"):
        processing.expand("<image><image>", processing.preprocess(ONE))


def features(model, images):
    processed = model.vision.processing.preprocess(images)
    return model.vision.encode(torch.cat([p.pixel_values for p in processed]),
                               torch.cat([p.pixel_attention_mask for p in processed])), processed


def test_vision_features_match_get_image_features(hf, ours):
    processor, hf_model = hf
    model = ours[0]
    inputs = hf_inputs(processor, PROMPT_3, THREE)
    with torch.no_grad():
        want = torch.cat(hf_model.model.get_image_features(inputs["pixel_values"],
                                                           inputs["pixel_attention_mask"]).pooler_output)
    got, _ = features(model, THREE)
    assert got.shape == want.shape == (13 * IMAGE_SEQ_LEN, model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_vision_features_of_partly_padded_tiles_match(hf, ours):
    """Tiles with padding (the processor never makes them, a caller may): positions stretched over
    the valid patches and padding keys masked, as transformers does."""
    _, hf_model = hf
    vision = ours[0].vision
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 64, 64, dtype=torch.bool)
    mask[0, 24:] = False  # 2 of 4 patch rows valid (a patch with any valid pixel is valid)
    mask[1, :, 20:] = False  # 2 of 4 patch columns valid
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixels[None], mask[None]).pooler_output[0]
    torch.testing.assert_close(vision.encode(pixels, mask), want, atol=1e-5, rtol=1e-5)


def test_vision_encode_masks_padding_patches(ours):
    """A tile whose lower half is padding: its valid patches see only each other (the mask reaches
    attention), so the padding's pixels do not matter."""
    vision = ours[0].vision
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 64, 64, dtype=torch.bool)
    mask[:, :32] = True
    other = pixels.clone()
    other[:, :, 32:] = 5.0
    assert torch.allclose(vision.encode(pixels, mask)[:2], vision.encode(other, mask)[:2], atol=1e-5)
    assert not torch.allclose(vision.encode(pixels)[:2], vision.encode(other)[:2], atol=1e-3)


def prompt(ours, text, images):
    """(ids, embed_rows, embeds) of `text` with `images`, as the engine will feed them."""
    model, tokenizer, config = ours
    embeds, processed = features(model, images)
    ids = tokenizer.encode(model.vision.processing.expand(text, processed))
    rows = [i for i, t in enumerate(ids) if t == config.image_token_id]
    assert len(rows) == embeds.shape[0]
    return ids, rows, embeds


def forward(model, config, kv, chunk, rows, embeds, all_rows=False):
    """One chunk; `rows` index the whole prompt, so only those inside the chunk are given."""
    batch, _ = host_batch([chunk], PAGE)
    lo, hi = chunk.start_pos, chunk.start_pos + len(chunk.tokens)
    inside = [(r - lo, e) for r, e in zip(rows, embeds) if lo <= r < hi]
    if inside:
        batch.embed_rows = torch.tensor([r for r, _ in inside])
        batch.embeds = torch.stack([e for _, e in inside])
    if all_rows:
        batch.sample_indices = torch.arange(len(chunk.tokens))
    with torch.no_grad():
        return model(batch, kv)


PAGES = [9, 3, 14, 1, 20, 7, 11, 2, 30, 5, 17, 25, 28, 6, 19, 22, 4, 8, 10, 12, 13, 15, 16, 18, 21, 23,
         24, 26, 27, 29, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]


def test_prompt_logits_match_transformers(hf, ours):
    """Every position's logits, 3 images in a 2-turn chat, one ForwardBatch over the whole prompt."""
    processor, hf_model = hf
    model, _, config = ours
    ids, rows, embeds = prompt(ours, PROMPT_3, THREE)
    kv = KVCache(config, num_pages=48, page_size=PAGE, dtype=torch.float32, device="cpu")
    got = forward(model, config, kv, Chunk(ids, 0, PAGES), rows, embeds, all_rows=True)
    inputs = hf_inputs(processor, PROMPT_3, THREE)
    with torch.no_grad():
        want = hf_model(**inputs).logits[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prefill_chunked_through_an_image_then_greedy_tokens_match(hf, ours):
    """The prompt in three chunks, cut inside an image's placeholder run, then 6 greedy decode
    steps; transformers recomputes the whole sequence at every step."""
    processor, hf_model = hf
    model, _, config = ours
    ids, rows, embeds = prompt(ours, PROMPT_1, ONE)
    cuts = [0, rows[5], rows[13], len(ids)]  # both cuts fall between two placeholders
    assert ids[cuts[1] - 1] == ids[cuts[1]] == config.image_token_id
    kv = KVCache(config, num_pages=48, page_size=PAGE, dtype=torch.float32, device="cpu")
    for lo, hi in zip(cuts, cuts[1:]):
        logits = forward(model, config, kv, Chunk(ids[lo:hi], lo, PAGES), rows, embeds)
    inputs = hf_inputs(processor, PROMPT_1, ONE)
    seq = inputs["input_ids"]
    assert seq[0].tolist() == ids
    for _ in range(6):
        with torch.no_grad():
            want = hf_model(input_ids=seq, pixel_values=inputs["pixel_values"],
                            pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
        token = int(want.argmax())
        assert int(logits[0].argmax()) == token
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
        logits = forward(model, config, kv, Chunk([token], seq.shape[1] - 1, PAGES), rows, embeds)


def test_packed_cpu_path_matches_dense(idefics3_folder, ours):
    from slipstream.models.kernels.cpu_linear import PackedLinear, onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    dense, _, config = ours
    packed, _, _ = build_model(str(idefics3_folder), "float32", torch.device("cpu"), pack=True)
    assert isinstance(packed.model.layers[0].mlp.up_proj, PackedLinear) and packed.vision is not None
    ids, rows, embeds = prompt(ours, PROMPT_1, ONE)
    outs = []
    for model in (dense, packed):
        kv = KVCache(config, num_pages=48, page_size=PAGE, dtype=torch.float32, device="cpu")
        outs.append(forward(model, config, kv, Chunk(ids, 0, PAGES), rows, features(model, ONE)[0]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_loaded_model_and_tokenizer(ours):
    model, tokenizer, config = ours
    assert config.image_token_id == tokenizer.token_to_id("<image>")
    assert config.vision.tokens_per_tile == IMAGE_SEQ_LEN and not config.tie_word_embeddings
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<end_of_utterance>"),)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                           {"type": "text", "text": "hi"}]}])
    assert rendered == "<|im_start|>User:<image>hi<end_of_utterance>\nAssistant:"
    assert tokenizer.encode("<row_2_col_1><global-img>") == [tokenizer.token_to_id("<row_2_col_1>"),
                                                            tokenizer.token_to_id("<global-img>")]


def test_a_wrong_image_token_id_is_refused(idefics3_folder, tmp_path):
    import json
    import shutil

    from slipstream.models.loading.loader import load_model

    folder = tmp_path / "bad"
    shutil.copytree(idefics3_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["image_token_id"] = 7
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptModelError, match="image_token_id=7"):
        load_model(str(folder))


@pytest.mark.cuda
def test_cuda_encode_reads_nothing_back(idefics3_folder, ours):
    """On a GPU the encode only enqueues work (it runs inside the encoder launch: a device-to-host
    read there stalls the loop's thread): torch's sync debug mode set to error, with no mask, an
    all-valid mask and a partly padded one; the features match the CPU's."""
    cuda = torch.device("cuda")
    vision = build_model(str(idefics3_folder), "float32", cuda)[0].vision
    processed = vision.processing.preprocess(THREE)
    pixels = torch.cat([p.pixel_values for p in processed])
    mask = torch.cat([p.pixel_attention_mask for p in processed]).bool()
    padded = mask.clone()
    padded[0, 24:] = False
    masks = (None, mask, padded)
    with torch.no_grad():
        want = [ours[0].vision.encode(pixels, m) for m in masks]
        on_device = [(pixels.to(cuda), None if m is None else m.to(cuda)) for m in masks]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = [vision.encode(p, m) for p, m in on_device]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for g, w in zip(got, want):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), w, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(got[1].cpu(), got[2].cpu(), atol=1e-3)  # the padding mask reached attention
