"""``ludic serve reward`` on a real vLLM engine: ``/score`` parity with transformers (raw
and normalized, texts and token ids), input order, agreement with vLLM's ``/classify``,
400s that name the bad field, the API key and the shared control routes."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import httpx  # noqa: E402
import torch  # noqa: E402
from tests.vllm_reward.helpers import AUTH, MAX_ABS_SCORE_DIFF, max_abs_diff  # noqa: E402

from ludic.inference.vllm.process import wait_for_vllm_health  # noqa: E402

TEXTS = [
    "a",
    "Is 2 + 3 = 5?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Reward models read the whole sequence and score its last token. " * 12,  # ~780 tokens
]


def test_health_reports_a_reward_model_and_its_version(served_reward):
    health = httpx.get(f"{served_reward.url}/health").json()
    version = httpx.get(f"{served_reward.url}/runtime_version", headers=AUTH).json()["version"]
    assert len(health.pop("boot_id")) == 32
    assert health == {"status": "ok", "type": "reward_model", "version": version}


def test_world_size_and_runtime_version_need_the_key(served_reward):
    assert httpx.get(f"{served_reward.url}/get_world_size").status_code == 401
    world = httpx.get(f"{served_reward.url}/get_world_size", headers=AUTH).json()
    assert world == {"world_size": 1}
    version = httpx.get(f"{served_reward.url}/runtime_version", headers=AUTH).json()["version"]
    assert isinstance(version, int) and version >= 0


def test_health_wait_refuses_a_server_of_another_type(served_reward):
    with pytest.raises(RuntimeError, match="reports type 'reward_model'.*expected 'policy'"):
        wait_for_vllm_health(served_reward.url, timeout_s=10, server_type="policy")
    wait_for_vllm_health(served_reward.url, timeout_s=10, server_type="reward_model")


def test_raw_scores_match_transformers_for_texts_of_different_lengths(served_reward):
    scores = served_reward.scores(TEXTS, normalize=False)
    reference = served_reward.reference(TEXTS)
    assert max_abs_diff(scores, reference) <= MAX_ABS_SCORE_DIFF


def test_raw_scores_match_transformers_for_token_ids_and_mixed_inputs(served_reward):
    ids = [[72, 105], list(range(40, 140)), [256, 257, 72, 101, 108, 108, 111]]
    mixed = [TEXTS[1], ids[0], TEXTS[2], ids[1]]
    assert (
        max_abs_diff(served_reward.scores(ids, normalize=False), served_reward.reference(ids))
        <= MAX_ABS_SCORE_DIFF
    )
    assert (
        max_abs_diff(served_reward.scores(mixed, normalize=False), served_reward.reference(mixed))
        <= MAX_ABS_SCORE_DIFF
    )


def test_a_text_and_its_token_ids_get_the_same_score(served_reward):
    ids = served_reward.tokenizer(TEXTS[2])["input_ids"]
    text_score, ids_score = served_reward.scores([TEXTS[2], ids], normalize=False)
    assert abs(text_score - ids_score) <= 1e-5


def test_normalized_scores_are_the_sigmoid_of_the_logits_and_the_default(served_reward):
    logits = torch.tensor(served_reward.reference(TEXTS))
    expected = torch.sigmoid(logits).tolist()
    assert max_abs_diff(served_reward.scores(TEXTS, normalize=True), expected) <= 1e-5
    assert max_abs_diff(served_reward.scores(TEXTS), expected) <= 1e-5


def test_a_batch_of_16_keeps_input_order(served_reward):
    texts = [f"answer {i}: " + "step " * (3 * i) for i in range(16)]
    reference = served_reward.reference(texts)
    assert len({round(r, 4) for r in reference}) == 16  # distinct, so order is visible
    scores = served_reward.scores(texts, normalize=False)
    assert max_abs_diff(scores, reference) <= MAX_ABS_SCORE_DIFF


def test_concurrent_requests_each_get_their_own_scores(served_reward):
    batches = [[f"batch {b} item {i} " * (b + 1) for i in range(4)] for b in range(4)]

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        f"{served_reward.url}/score",
                        json={"input": b, "normalize": False},
                        headers=AUTH,
                    )
                    for b in batches
                )
            )

    for batch, response in zip(batches, asyncio.run(run())):
        assert response.status_code == 200, response.text
        scores = [d["score"] for d in response.json()["data"]]
        assert max_abs_diff(scores, served_reward.reference(batch)) <= MAX_ABS_SCORE_DIFF


def test_score_agrees_with_vllm_classify(served_reward):
    for activation in (False, True):
        classify = httpx.post(
            f"{served_reward.url}/classify",
            json={"input": TEXTS, "use_activation": activation},
            headers=AUTH,
            timeout=60,
        )
        assert classify.status_code == 200, classify.text
        probs = [d["probs"][0] for d in classify.json()["data"]]
        assert max_abs_diff(served_reward.scores(TEXTS, normalize=activation), probs) <= 1e-5


def test_response_names_the_model_counts_tokens_and_carries_the_version(served_reward):
    response = served_reward.post_score({"input": TEXTS[:2], "pooling_type": "last"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == str(served_reward.model_dir)
    assert body["usage"] == {"prompt_tokens": sum(len(t.encode()) for t in TEXTS[:2])}
    version = httpx.get(f"{served_reward.url}/runtime_version", headers=AUTH).json()["version"]
    assert response.headers["x-ludic-policy-version"] == str(version)
    named = served_reward.post_score({"input": ["x"], "model": str(served_reward.model_dir)})
    assert named.status_code == 200 and named.json()["model"] == str(served_reward.model_dir)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "input is missing"),
        ({"input": []}, "input must be a non-empty list"),
        ({"input": "one text"}, "input must be a list, got one string"),
        ({"input": {"a": 1}}, "input must be a non-empty list"),
        ({"input": ["ok", 3]}, "input[1]"),
        ({"input": ["ok", ""]}, "input[1] is an empty string"),
        ({"input": [[]]}, "input[0] must be a string or a non-empty list"),
        ({"input": [[72, "a"]]}, "input[0][1] must be a token id"),
        ({"input": [[72, True]]}, "input[0][1] must be a token id"),
        ({"input": [[72, 10**6]]}, "input[0][1]=1000000 is not a token id"),
        ({"input": [[-1]]}, "input[0][0]=-1 is not a token id"),
        ({"input": ["ok", "x" * 2000]}, "input[1]:"),  # longer than max_model_len
        ({"input": ["x"], "normalize": "yes"}, "normalize must be true or false"),
        ({"input": ["x"], "pooling_type": "mean"}, "pooling_type='mean'"),
        ({"input": ["x"], "return_hidden_states": True}, "return_hidden_states=True"),
        ({"input": ["x"], "model": "other"}, "model='other' is not served"),
        ({"input": ["x"], "temperature": 1.0}, "unknown field(s) ['temperature']"),
        (["x"], "body must be a JSON object"),
    ],
)
def test_bad_score_bodies_are_a_400_naming_the_field(served_reward, body, field):
    response = served_reward.post_score(body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(served_reward):
    response = httpx.post(f"{served_reward.url}/score", content=b"{not json", headers=AUTH)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_the_server_keeps_serving_after_bad_requests(served_reward):
    assert served_reward.post_score({"input": ["x" * 2000]}).status_code == 400
    scores = served_reward.scores(TEXTS[:2], normalize=False)
    assert max_abs_diff(scores, served_reward.reference(TEXTS[:2])) <= MAX_ABS_SCORE_DIFF


@pytest.mark.parametrize(
    "path",
    [
        "/score",
        "/init_communicator",
        "/update_param_batch",
        "/close_communicator",
        "/get_num_background_tasks",
        "/reset_prefix_cache",
        "/pause",
        "/resume",
    ],
)
def test_post_routes_need_the_api_key(served_reward, path):
    url = served_reward.url + path
    body = {"input": ["x"]}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_api_key_opens_the_control_routes(served_reward):
    response = httpx.post(f"{served_reward.url}/get_num_background_tasks", headers=AUTH)
    assert response.status_code == 200
    assert response.json()["num_background_tasks"] == 0


def test_every_route_but_health_needs_the_key(served_reward):
    """Issue 9, part 2: vLLM's /classify, /pooling, /tokenize, /metrics, /docs ... were
    open on a keyed reward server. Swept from the running app's own route list."""
    schema = httpx.get(f"{served_reward.url}/openapi.json", headers=AUTH, timeout=30).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", p) for p in ("/docs", "/redoc", "/openapi.json", "/metrics")]
    paths = {p for _, p in routes}
    assert {"/classify", "/pooling", "/score", "/tokenize"} <= paths
    with httpx.Client(base_url=served_reward.url, timeout=30) as http:
        open_routes = [
            (m, p) for m, p in routes if p != "/health" and http.request(m, p).status_code != 401
        ]
        refused = [
            (m, p)
            for m, p in routes
            if http.request(m, p, headers=AUTH, content=b"{").status_code == 401
        ]
        http.post("/resume", headers=AUTH)  # the sweep's keyed /pause, undone
        assert http.get("/health").status_code == 200
    assert not open_routes, f"answered without the key: {open_routes}"
    assert not refused, f"refused with the key: {refused}"
