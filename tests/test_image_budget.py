"""Pixel budgets (issue 37, item 9): one request's pictures at most `max_request_pixels` in all,
refused from their headers before any is decoded; the decoded pictures alive in the process at most
`max_inflight_pixels` (OverloadedError, retry later), given back when they are freed, and the
allocator's free memory returned to the system once none is left."""
import gc

import pytest
from image_util import encoded, png_header_only

from slipstream import images
from slipstream.errors import InvalidRequestError, OverloadedError
from slipstream.images import ImageLimits, load_request_images


def test_a_request_over_its_pixel_budget_is_refused_from_the_headers_before_any_decode():
    limits = ImageLimits(max_request_pixels=5000)
    corrupt = png_header_only(50, 50)  # 2,500 pixels by its header; decoding it would fail
    with pytest.raises(InvalidRequestError) as info:
        load_request_images([corrupt, encoded(50, 40), encoded(30, 20)], ["images[0]", "images[1]", "images[2]"],
                            limits)
    assert info.value.param == "images[2]" and "5,100 pixels" in str(info.value)
    assert len(load_request_images([encoded(50, 50), encoded(50, 50)], ["a", "b"], limits)) == 2  # 5,000: fits


def test_decoded_pictures_in_the_process_are_bounded_and_given_back():
    gc.collect()
    limits = ImageLimits(max_inflight_pixels=images.pixels_held() + 6000)
    held = load_request_images([encoded(50, 50), encoded(50, 50)], ["images[0]", "images[1]"], limits)
    with pytest.raises(OverloadedError, match="retry"):
        load_request_images([encoded(40, 40)], ["images[0]"], limits)
    del held
    gc.collect()
    assert len(load_request_images([encoded(40, 40)], ["images[0]"], limits)) == 1


def test_a_picture_that_fails_to_decode_gives_its_pixels_back():
    gc.collect()
    before = images.pixels_held()
    with pytest.raises(InvalidRequestError):
        load_request_images([png_header_only(60, 60)], ["images[0]"])
    gc.collect()
    assert images.pixels_held() == before


def test_memory_is_returned_once_the_last_big_picture_is_freed(monkeypatch):
    trims = []
    monkeypatch.setattr(images, "TRIM_PIXELS", 1000)
    monkeypatch.setattr(images, "_freed", 0)
    monkeypatch.setattr(images, "_trim", lambda: trims.append(1))
    gc.collect()
    got = load_request_images([encoded(40, 40), encoded(10, 10)], ["a", "b"])
    assert trims == []
    del got
    gc.collect()
    assert trims == [1]  # once, when none is left
