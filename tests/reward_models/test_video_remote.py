"""Remote video rewards against servers on 127.0.0.1 only: the reference reward server serving video scorers
(remote_video, videoalign), and a stub OpenAI-compatible judge (video_vlm_judge). Clips are tiny (4 frames of
16 x 16), every network loop is bounded in attempts and time."""

import base64
import io
import json
import time

import av
import numpy as np
import pytest
import torch

from reward_models import build_scorer
from reward_models.remote import RemoteRewardError
from reward_models.serving import ServerLimits, make_server
from reward_models.video import VideoScorer, motion_magnitude
import reward_models.video_judge  # noqa: F401  (registers video_vlm_judge until the registry lists it)
from reward_models.video_judge import VideoVLMJudge, sample_frames
from reward_models.wire import WireError, decode_clips, encode_clip

from test_rewards_vlm_judge import JudgeStub, decode_images, free_port, mean_level, serving

FAST = dict(timeout_s=2.0, max_attempts=2, backoff_s=0.02, max_backoff_s=0.05, seed=0)


def quantised_clips(levels, frames=4, size=16) -> torch.Tensor:
    """Clips [B, F, 3, size, size] on the uint8 grid (PNG round-trips them exactly); clip b fades from levels[b]."""
    torch.manual_seed(0)
    base = torch.tensor(levels).view(-1, 1, 1, 1, 1) + 0.1 * torch.arange(frames).view(1, -1, 1, 1, 1)
    clips = (base + 0.05 * torch.rand(len(levels), frames, 3, size, size)).clamp(0, 1)
    return (clips * 255).round() / 255


class HeadsScorer(VideoScorer):
    """A stand-in for VideoAlign: VQ = mean brightness, MQ = motion magnitude, TA = 0.5."""

    name = "heads"

    def score_clips(self, clips, prompts, metadata):
        vq, mq = clips.flatten(1).mean(1), motion_magnitude(clips)
        return {self.key: vq + mq + 0.5, f"{self.key}/VQ": vq, f"{self.key}/MQ": mq, f"{self.key}/TA": vq * 0 + 0.5}


@pytest.fixture(scope="module")
def motion_server():
    server = make_server(build_scorer("motion_magnitude"))
    server.serve_in_thread()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("clip_format,tol", [("png", 0.0), ("jpeg", 0.02), ("mp4", 0.05)])
def test_remote_video_scores_like_the_local_scorer(motion_server, clip_format, tol):
    clips = quantised_clips([0.1, 0.5, 0.2])
    remote = build_scorer("remote_video", url=motion_server.url, clip_format=clip_format, batch_size=2, **FAST)
    out = remote(clips)
    assert set(out) == {"motion_magnitude"}  # the server's key
    torch.testing.assert_close(out["motion_magnitude"], motion_magnitude(clips), atol=tol, rtol=0)
    assert remote.counters["calls"] == 1 and remote.counters["videos"] == 3


def test_clip_wire_formats_round_trip_and_sizes():
    clip = quantised_clips([0.3], frames=3, size=24)[0]
    png, jpeg, mp4 = (encode_clip(clip, f) for f in ("png", "jpeg", "mp4"))
    torch.testing.assert_close(decode_clips([png])[0], clip, atol=0, rtol=0)  # lossless
    assert len(jpeg["frames"]) == 3 and sum(map(len, jpeg["frames"])) < sum(map(len, png["frames"]))
    with av.open(io.BytesIO(base64.b64decode(mp4["data"]))) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    assert decode_clips([mp4]).shape == (1, 3, 3, 24, 24)
    with pytest.raises(WireError, match="clips differ in shape"):
        decode_clips([png, encode_clip(clip[:2], "png")])
    with pytest.raises(WireError, match="'format' one of"):
        decode_clips([{"frames": png["frames"]}])
    with pytest.raises(ValueError, match="clip_format must be one of"):
        encode_clip(clip, "gif")


def test_videoalign_weights_the_three_heads():
    server = make_server(HeadsScorer())
    server.serve_in_thread()
    try:
        clips = quantised_clips([0.1, 0.6])
        scorer = build_scorer("videoalign", url=server.url, vq=1.0, mq=0.0, ta=2.0, key="va", **FAST)
        out = scorer(clips, ["a", "b"])
        assert set(out) == {"va", "va/VQ", "va/MQ", "va/TA"}
        torch.testing.assert_close(out["va"], out["va/VQ"] + 2.0 * 0.5)
        torch.testing.assert_close(out["va/MQ"], motion_magnitude(clips))
    finally:
        server.shutdown()
        server.server_close()


def test_videoalign_without_heads_is_a_bad_answer(motion_server):
    clips = quantised_clips([0.2])
    with pytest.raises(RemoteRewardError, match=r"without the heads \['VQ', 'MQ', 'TA'\]"):
        build_scorer("videoalign", url=motion_server.url, **FAST)(clips)
    lenient = build_scorer("videoalign", url=motion_server.url, on_bad_response="nan", **FAST)
    assert torch.isnan(lenient(clips)["videoalign"]).all() and lenient.counters["bad_responses"] == 1


def test_image_and_video_sides_refuse_each_other(motion_server):
    with pytest.raises(RemoteRewardError, match="scores videos, not images: use scorer 'remote_video'"):
        build_scorer("remote", url=motion_server.url, **FAST)(torch.rand(2, 3, 8, 8))
    image_server = make_server(build_scorer("brightness"))
    image_server.serve_in_thread()
    try:
        with pytest.raises(RemoteRewardError, match="scores images, not videos: use scorer 'remote'"):
            build_scorer("remote_video", url=image_server.url, **FAST)(quantised_clips([0.2]))
        # without the health check the server itself refuses the request (400, not retried)
        blind = build_scorer("remote_video", url=image_server.url, health_check=False, **FAST)
        with pytest.raises(RemoteRewardError, match="this server scores images; send 'images'"):
            blind(quantised_clips([0.2]))
    finally:
        image_server.shutdown()
        image_server.server_close()


def test_oversized_clips_are_refused_before_decoding():
    server = make_server(build_scorer("motion_magnitude"), limits=ServerLimits(max_request_pixels=3 * 16 * 16))
    server.serve_in_thread()
    try:
        with pytest.raises(RemoteRewardError, match="413"):
            build_scorer("remote_video", url=server.url, **FAST)(quantised_clips([0.2]))  # 4 frames > 3
    finally:
        server.shutdown()
        server.server_close()


def test_down_video_server_fails_loud_within_bounded_time():
    scorer = build_scorer("remote_video", url=f"http://127.0.0.1:{free_port()}", **FAST)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="127.0.0.1"):
        scorer(quantised_clips([0.2]))
    assert time.monotonic() - start < 5.0


def brightness_of_frames(body: dict) -> str:
    frames = decode_images(body)
    return f"{len(frames)} frames.\nFinal Score: {round(1 + 9 * float(np.mean([mean_level(f) for f in frames])))}"


def test_video_judge_sends_sampled_frames_in_one_message():
    stub = JudgeStub(answer=brightness_of_frames)
    clips = quantised_clips([0.0, 0.6], frames=6)
    with serving(stub) as url:
        judge = build_scorer("video_vlm_judge", url=url, num_frames=3, concurrency=2, **FAST)
        out = judge(clips, ["a cat", "a dog"])
    assert len(stub.bodies) == 2 and all(len(decode_images(b)) == 3 for b in stub.bodies)
    assert out["video_vlm_judge"][1] > out["video_vlm_judge"][0]  # the brighter clip scores higher
    texts = {b["messages"][0]["content"][-1]["text"] for b in stub.bodies}
    assert all(any(f'prompt: "{p}"' in t for t in texts) for p in ("a cat", "a dog"))
    assert judge.last_replies[0].startswith("3 frames")
    assert sample_frames(6, 3) == [0, 2, 5] and sample_frames(4, None) == [0, 1, 2, 3]


def test_video_judge_video_url_part():
    def answer(body):
        (part,) = [p for p in body["messages"][0]["content"] if p["type"] == "video_url"]
        assert part["video_url"]["url"].startswith("data:video/mp4;base64,")
        return "Final Score: 7"

    stub = JudgeStub(answer=answer)
    with serving(stub) as url:
        out = build_scorer("video_vlm_judge", url=url, video_input="video_url", **FAST)(quantised_clips([0.2]), ["x"])
    torch.testing.assert_close(out["video_vlm_judge"], torch.tensor([6 / 9]))
    assert out["video_vlm_judge/raw"].item() == 7.0


def test_video_judge_failures_nan_or_loud():
    clips = quantised_clips([0.2, 0.4])
    with serving(JudgeStub(mode="garbage")) as url:
        judge = build_scorer("video_vlm_judge", url=url, **FAST)
        assert torch.isnan(judge(clips, ["a", "b"])["video_vlm_judge"]).all()
        assert judge.counters["bad_responses"] == 2
    with serving(JudgeStub(mode="error")) as url, pytest.raises(RemoteRewardError):
        build_scorer("video_vlm_judge", url=url, **FAST)(clips, ["a", "b"])


def test_video_judge_bad_settings_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"video_input must be one of \('frames', 'video_url'\), got 'gif'"):
        VideoVLMJudge("http://127.0.0.1:1", video_input="gif", model="m")
    with pytest.raises(ValueError, match="num_frames must be >= 1"):
        VideoVLMJudge("http://127.0.0.1:1", num_frames=0, model="m")
    with pytest.raises(ValueError, match="clip_format must be one of"):
        build_scorer("remote_video", url="http://127.0.0.1:1", clip_format="gif")


def test_registered_and_listed():
    from reward_models import available

    assert {"remote_video", "videoalign", "video_vlm_judge"} <= set(available("pointwise"))
    assert json.dumps(make_server(HeadsScorer()).health_info())  # health says what it reads
    assert make_server(HeadsScorer()).health_info()["inputs"] == "videos"
