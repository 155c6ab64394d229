"""Request ``priority`` at the front ends (vLLM's field and ``LLM.generate`` argument): honoured
under ``--scheduling-policy priority``, a 400 (``param: "priority"``) under the other policies
and for a value that is not a 32-bit integer; and the policy reaching the scheduler."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hyprefix.config import EngineArgs
from hyprefix.demo import demo_model_path
from hyprefix.engine_config import EngineConfig
from hyprefix.errors import RequestError
from hyprefix.llm import LLM
from hyprefix.sampling import SamplingParams
from hyprefix.server import build_app

MODEL = "demo"


HIGHEST = -3  # the priority server's --highest-request-priority


def _llm(policy: str) -> LLM:
    cap = {"highest_request_priority": HIGHEST} if policy == "priority" else {}
    return LLM(str(demo_model_path("dense")), num_kv_blocks=64, max_num_seqs=1, enforce_eager=True,
               log_stats_interval=0, scheduling_policy=policy, **cap)


@pytest.fixture(scope="module")
def servers():
    """(priority LLM, its HTTP client, fcfs LLM, its HTTP client)."""
    llm, fcfs = _llm("priority"), _llm("fcfs")
    with TestClient(build_app(llm.engine, [MODEL])) as http, TestClient(build_app(fcfs.engine, [MODEL])) as plain:
        yield llm, http, fcfs, plain


def _post(http: TestClient, endpoint: str, **fields):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, **fields}
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return http.post(f"/v1/{endpoint}", json=body)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_priority_is_honoured_under_the_priority_policy_and_a_400_under_fcfs(servers, endpoint):
    _, http, _, plain = servers
    for priority in (5, -2, 0, None):
        assert _post(http, endpoint, priority=priority).status_code == 200
    for priority in (0, None):
        assert _post(plain, endpoint, priority=priority).status_code == 200
    refused = _post(plain, endpoint, priority=1)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "priority" and "scheduling-policy priority" in error["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_priority_above_the_highest_allowed_is_capped_and_the_response_says_so(servers, endpoint):
    llm, http, _, _ = servers
    if endpoint == "completions":  # the engine queues what it granted
        llm.engine.add_requests([("capped", [5, 6, 7], SamplingParams(max_tokens=1, priority=-9))])
        assert llm.engine.scheduler.requests["capped"].priority == HIGHEST
        while llm.engine.has_unfinished():
            llm.engine.step()
    for asked, granted in ((-9, HIGHEST), (HIGHEST, HIGHEST), (4, 4), (None, None)):
        body = _post(http, endpoint, priority=asked).json()
        assert body.get("priority") == granted, (asked, body)
        chunks = [line for line in _post(http, endpoint, priority=asked, stream=True).text.splitlines()
                  if line.startswith("data: {")]
        finals = [c for c in chunks if '"finish_reason":"' in c.replace(" ", "")]
        assert finals and all((f'"priority":{granted}' in c.replace(" ", "")) == (granted is not None)
                              for c in finals), (asked, finals)
        assert not any('"priority"' in c for c in chunks if c not in finals)


@pytest.mark.parametrize("bad", ["high", 1.5, True, 2**31, -(2**31) - 1, [1]])
def test_a_priority_that_is_not_a_32_bit_integer_is_a_400(servers, bad):
    _, http, _, _ = servers
    response = _post(http, "completions", priority=bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


def test_llm_generate_takes_one_priority_a_prompt(servers):
    _, _, llm, _ = servers
    params = SamplingParams(temperature=0, max_tokens=2)
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(RequestError, match="scheduling-policy priority"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 3])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0])
    assert not llm.engine.has_unfinished()  # nothing was queued
    # the engine's own entry refuses it too, before queueing anything
    with pytest.raises(RequestError, match="scheduling-policy priority"):
        llm.engine.add_requests([("direct", [1, 2, 3], SamplingParams(max_tokens=2, priority=1))])
    assert not llm.engine.has_unfinished()


def test_the_policy_reaches_the_scheduler_and_orders_generate(servers):
    config = EngineConfig.from_args(EngineArgs(scheduling_policy="cache-aware", scheduling_max_wait_s=7.5))
    assert (config.scheduler.policy, config.scheduler.max_wait_s) == ("cache-aware", 7.5)
    llm = servers[0]
    assert llm.engine.scheduler.policy.name == "priority"
    outs = llm.generate(["one", "two", "three"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                        priority=[2, 0, 1])  # one slot: served by priority
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
