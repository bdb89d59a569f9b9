"""OpenAI request bodies → GenerateCall (specserve/openai/protocol.py): each refusal names its field."""

from __future__ import annotations

import pytest

from specserve.openai.protocol import OpenAIError, parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_fields_become_sampling_parameters():
    call = parse_chat({**CHAT, "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0, "top_p": 0.5,
                       "seed": 4, "stop": "x", "n": 1, "stream": True, "stream_options": {"include_usage": True},
                       "spec_method": "ngram", "stop_token_ids": [2], "user": "u", "presence_penalty": 0})
    assert call.sampling == {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "seed": 4, "stop": ["x"],
                             "spec_method": "ngram", "stop_token_ids": [2]}
    assert (call.stream, call.include_usage, call.prompt) == (True, True, None)
    assert call.messages == [{"role": "user", "content": "hi"}]
    # OpenAI's defaults: temperature 1, max_tokens left to the model length (app.py).
    assert parse_chat(CHAT).sampling == {"temperature": 1.0}


def test_text_parts_are_joined():
    call = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert call.messages[0]["content"] == "ab"


@pytest.mark.parametrize("extra,param", [
    ({"n": 3}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"), ({"top_p": True}, "top_p"), ({"seed": "1"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"frobnicate": 1}, "frobnicate"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"num_draft_tokens": True}, "num_draft_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_chat_refusals_name_the_field(extra, param):
    with pytest.raises(OpenAIError) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.param == param and e.value.status == 400
    assert e.value.body()["error"]["param"] == param


def test_completion_takes_one_prompt():
    assert parse_completion({"prompt": ["one"]}).prompt == "one"
    for prompt in (["a", "b"], [1, 2], "", None):
        with pytest.raises(OpenAIError) as e:
            parse_completion({"prompt": prompt})
        assert e.value.param == "prompt"
    with pytest.raises(OpenAIError) as e:
        parse_completion({"prompt": "x", "max_completion_tokens": 3})   # a chat field
    assert e.value.param == "max_completion_tokens"
