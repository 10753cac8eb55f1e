"""The data-parallel routing policy without HTTP: prefix affinity above the threshold, the least-loaded replica
otherwise, the load-gap override, replicas marked down, the bounded index; the routing text of each endpoint's
body; the front door's metrics with a replica label."""

from __future__ import annotations

import pytest

from deltaspec.server.data_parallel.metrics import labelled_families, render
from deltaspec.server.data_parallel.prompt_text import routing_text
from deltaspec.server.data_parallel.router import NoReplica, PrefixIndex, PrefixRouter, RouterSettings, prompt_of

SYSTEM = "You are a careful assistant who answers questions about Python with short, correct examples. " * 3


def chat(*contents: str) -> dict:
    roles = ["system", "user", "assistant"]
    return {"messages": [{"role": roles[min(i, 1 + i % 2)], "content": c} for i, c in enumerate(contents)]}


def text_of(body: dict) -> str:
    return routing_text("/v1/chat/completions", body)


def test_a_follow_up_goes_where_its_prefix_went():
    router = PrefixRouter(2)
    first = router.choose(router.prompt(text_of(chat(SYSTEM, "Write a function that adds two numbers."))))
    other = router.choose(router.prompt(text_of(chat("Something else entirely, " * 10, "and more."))))
    follow_up = chat(SYSTEM, "Write a function that adds two numbers.", "def add(a, b): ...", "Now subtract.")
    again = router.choose(router.prompt(text_of(follow_up)))
    assert (first.replica, first.reason) == (0, "load")
    assert (other.replica, other.reason) == (1, "load")  # equal loads: the replica whose record is smaller
    assert (again.replica, again.reason) == (0, "prefix") and again.matched_chars >= len(SYSTEM)
    assert router.routed[0, "prefix"] == 1


def test_a_short_shared_prefix_is_below_the_threshold():
    router = PrefixRouter(2, RouterSettings(cache_threshold=0.5, block_chars=8))
    router.choose(router.prompt("a" * 64))
    router.started(0)
    route = router.choose(router.prompt("a" * 16 + "b" * 64))  # 16 of 80 characters match: 20% < 50%
    assert (route.replica, route.reason, route.matched_chars) == (1, "load", 0)


def test_the_least_loaded_replica_takes_unmatched_prompts():
    router = PrefixRouter(3, RouterSettings(block_chars=8))
    for replica, load in enumerate((2, 0, 1)):
        for _ in range(load):
            router.started(replica)
    assert router.choose(router.prompt("x" * 40)).replica == 1
    router.finished(0)
    router.finished(0)
    assert router.choose(None).replica == 0  # loads 0, 0, 1: 0's record is empty, 1's holds the prompt
    assert len(router.indexes[0]) == 0  # a request that does not generate is not recorded


def test_an_unbalanced_load_overrides_the_prefix():
    settings = RouterSettings(block_chars=8, balance_abs_threshold=2, balance_rel_threshold=1.5)
    router = PrefixRouter(2, settings)
    prompt = router.prompt("shared prefix " * 8)
    assert router.choose(prompt).replica == 0
    for _ in range(3):
        router.started(0)
    route = router.choose(prompt)  # 3 over 0 in flight: more than 2 more and more than 1.5 times as many
    assert (route.replica, route.reason) == (1, "balance")
    router.started(1)
    assert router.choose(prompt).reason == "prefix"  # 3 over 1: 2 more, not more than 2


def test_replicas_marked_down_are_not_chosen():
    router = PrefixRouter(2, RouterSettings(block_chars=8))
    prompt = router.prompt("y" * 32)
    router.choose(prompt)
    router.up[0] = False
    assert router.choose(prompt).replica == 1
    router.up[1] = False
    with pytest.raises(NoReplica):
        router.choose(prompt)


def test_the_index_is_bounded_and_evicts_paths_from_their_ends():
    index = PrefixIndex(max_blocks=6)
    old = prompt_of("a" * 32, 8).keys  # 4 blocks
    index.insert(old)
    new = prompt_of("b" * 32, 8).keys
    index.insert(new)
    assert len(index) == 6
    assert index.matched_blocks(new) == 4
    assert index.matched_blocks(old) == 2  # the older path lost its last two blocks, kept its first two
    index.insert(prompt_of("a" * 8 + "c" * 24, 8).keys)  # shares the old path's root, and refreshes it
    assert (index.matched_blocks(old), index.matched_blocks(new)) == (1, 2)


def test_keys_name_whole_prefixes():
    one, two = prompt_of("abcdefgh" * 3 + "xyz", 8), prompt_of("abcdefgh" * 2 + "ABCDEFGH", 8)
    assert one.length == 27 and len(one.keys) == 3  # a partial last block has no key
    assert one.keys[:2] == two.keys[:2] and one.keys[2] != two.keys[2]
    assert prompt_of("abcdefgh" * 2, 8).keys[1] != prompt_of("ABCDEFGH" + "abcdefgh", 8).keys[1]


def test_each_turn_of_a_conversation_starts_with_the_last_turns_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    first = {**chat(SYSTEM, "Hi"), "tools": tools}
    second = {**chat(SYSTEM, "Hi", "Hello!", "Bye"), "tools": tools}
    assert text_of(second).startswith(text_of(first)) and len(text_of(second)) > len(text_of(first))
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}]}
    assert text_of(parts).startswith("user:look{")
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}
    assert '"name":"f"' in text_of({"messages": [call]})


def test_each_endpoint_routes_on_its_prompt():
    assert routing_text("/v1/completions", {"prompt": "def f("}) == "def f("
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "[1,2,3]"
    assert routing_text("/completion", {"prompt": "x"}) == "x"
    responses = {"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, {"type": "item"}]}
    assert routing_text("/v1/responses", responses) == 'Be brief.\x1euser:hi\x1e{"type":"item"}'
    assert routing_text("/v1/responses", {"input": "hello"}) == "hello"
    assert routing_text("/v1/chat/completions", ["not", "an", "object"]) == ""


EXPOSITION = """# HELP deltaspec_num_requests_running Sequences running.
# TYPE deltaspec_num_requests_running gauge
deltaspec_num_requests_running 2.0
# HELP deltaspec_time_per_output_token_seconds TPOT.
# TYPE deltaspec_time_per_output_token_seconds histogram
deltaspec_time_per_output_token_seconds_bucket{le="+Inf"} 4.0
deltaspec_time_per_output_token_seconds_count 4.0
deltaspec_time_per_output_token_seconds_sum 0.5
"""


def test_the_replicas_metrics_carry_a_replica_label():
    families = {family.name: family for family in labelled_families({0: EXPOSITION, 1: EXPOSITION})}
    running = families["deltaspec_num_requests_running"]
    assert [(s.labels, s.value) for s in running.samples] == [({"replica": "0"}, 2.0), ({"replica": "1"}, 2.0)]
    router = PrefixRouter(2)
    router.started(1)
    text = render(router, {0: EXPOSITION, 1: EXPOSITION}).decode()
    assert 'deltaspec_router_requests_in_flight{replica="1"} 1.0' in text
    assert 'deltaspec_router_replica_up{replica="0"} 1.0' in text
    assert 'deltaspec_time_per_output_token_seconds_sum{replica="1"} 0.5' in text
    assert text.count("# TYPE deltaspec_num_requests_running gauge") == 1  # one family, both replicas' samples
