"""The engine token a publish sends (vime_core/weight_sync/publish_loop.py): the loop's own, else
its token source's answer at each publish, so a trainer that outlived the engines sends the
token of those that replaced them; weight_sync asks no cluster module for it."""

from vime_core.engines.auth import EngineToken
from vime_core.weight_sync.publish_loop import PublishLoop


def test_the_source_is_asked_at_each_publish():
    tokens = [EngineToken.new(), EngineToken.new()]
    answers = iter(tokens)
    loop = PublishLoop(token_source=lambda: next(answers))
    try:
        assert [loop.engine_token(), loop.engine_token()] == tokens
    finally:
        loop.close()


def test_the_loops_own_token_wins_over_its_source():
    own = EngineToken.new()
    loop = PublishLoop(token=own, token_source=lambda: EngineToken.new())
    try:
        assert loop.engine_token() is own
    finally:
        loop.close()


def test_without_either_no_token_is_sent():
    loop = PublishLoop()
    try:
        assert loop.engine_token() is None
    finally:
        loop.close()
