"""Prompt text whose length in tokens is controlled without a tokenizer.

The words are frequent, short, lowercase English words. In the byte-level BPE vocabularies of the usual
open models (GPT-2, Llama, Mistral, SmolLM, Qwen) each of them with its leading space is a single token,
so a prompt of N words joined by spaces is about N tokens (plus BOS / chat-template tokens). That keeps
the benchmark independent of the model's tokenizer; the server's ``usage.prompt_tokens`` reports the
exact count when it is available.
"""

from __future__ import annotations

import numpy as np

_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but have an
    had they you were their one all we can her has there been if more when will would who so no out up
    into do than only other new some could time these two may then first any my now such like our over
    man me even most made after also did many before must through back years where much your way well
    down should because each just those people how too little state good very make world still own see
    men work long get here between both life being under never day same another know while last might us
    great old year off come since against go came right used take three states himself few house use
    during without again place around however home small found thought went say part once general high
    upon school every does got united left number course war until always away something fact though
    water less public put think almost hand enough far took head yet government system better set told
    nothing night end why called mind find going look asked later knew point next program city business
    give group toward young days let room president side social present given several order national
    second possible rather per face among form important often things looked early white case money become
    large big need four within felt along children saw best church ever least power development light
    """
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def random_words(rng: np.random.Generator, count: int) -> str:
    """``count`` words drawn uniformly from :data:`WORDS`, joined by single spaces."""
    if count < 1:
        raise ValueError(f"count must be >= 1 (got {count})")
    picks = rng.integers(0, len(WORDS), size=count)
    return " ".join(WORDS[i] for i in picks)
