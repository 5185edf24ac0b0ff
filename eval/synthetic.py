"""A deterministic synthetic multi-document QA set for fast, download-free evaluation.

Each example invents organisations and people with attributes (founding year, seat, founder,
birthplace, birth year), writes one passage per entity, and asks a single-hop question ("In what
year was the Orvel Guild founded?") or a two-hop one ("In which city was the founder of the
Orvel Guild born?", which needs the organisation's passage and its founder's). Distractor
passages describe look-alike entities with different facts. Passages are padded with sentences
from templates up to a target length. The output is CacheBlend JSON, read by `eval.loaders`.

    python -m eval.synthetic --seed 0 -n 24 --passages 6 --passage-tokens 500 --out eval/data/synthetic_qa.json
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# SmolLM2 tokenizes this template English with invented names at about 4.3 characters a token.
CHARS_PER_TOKEN = 4.3

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "dr", "gr", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "l", "n", "r", "s", "th", "nd", "rk", "lm", "st")
_CITY_ENDINGS = ("ford", "haven", "mouth", "stead", "wick", "ton", "bury", "dale", "port", "holm")
_ORG_KINDS = ("Guild", "Society", "Company", "Observatory", "Institute", "Foundry", "Press", "Orchestra", "Academy", "Trust")
_PROFESSIONS = ("cartographer", "glassblower", "astronomer", "printer", "botanist", "clockmaker", "engineer", "composer", "surveyor", "weaver")
_ADJECTIVES = ("quiet", "ambitious", "careful", "unusual", "modest", "lively", "patient", "stubborn", "generous", "curious")
_THINGS = ("archives", "workshops", "letters", "ledgers", "drawings", "collections", "notebooks", "meetings", "records", "gardens")

_ORG_FILLER = (
    "Historians who have studied the {things} of {name} describe its early members as {adj} and {adj2}.",
    "Much of what is known about {name} comes from its surviving {things}, which are kept in good order.",
    "Visitors to {name} often remarked on the {adj} atmosphere of its {things}.",
    "Over the decades {name} gained a reputation for {adj} work and for {adj2} leadership.",
    "The members of {name} met regularly to discuss their {things} and to plan new work.",
    "Several accounts mention that {name} kept detailed {things} of every decision it made.",
    "Critics of {name} sometimes called its methods {adj}, while supporters called them {adj2}.",
    "A small exhibition about the {things} of {name} has toured local libraries.",
    "The history of {name} is closely tied to the towns and villages around it.",
    "Today {name} is remembered mainly through its {things} and the stories of its members.",
    "Newcomers to {name} were expected to study its {things} before taking part in its work.",
    "Letters from the period describe {name} as {adj}, though never as {adj2}.",
)
_PERSON_FILLER = (
    "Friends described {name} as {adj} and, on occasion, {adj2}.",
    "{name} kept {things} throughout a long working life, and many of them survive.",
    "As a {profession}, {name} was known for {adj} habits and {adj2} opinions.",
    "Colleagues recalled that {name} rarely spoke about private matters.",
    "The {things} of {name} show a {adj} mind with a taste for detail.",
    "{name} corresponded widely with other people who shared an interest in {things}.",
    "Later writers have portrayed {name} as a {adj} figure of the period.",
    "Few portraits of {name} exist, and those that do show a {adj} expression.",
    "{name} trained several younger people, who later spoke of a {adj2} teacher.",
    "Some of the {things} once owned by {name} are now held in a private collection.",
    "Throughout life {name} preferred {adj} work to public attention.",
    "{name} is said to have been {adj} with money but {adj2} with time.",
)


@dataclass(frozen=True)
class Person:
    """An invented person: the founder of an organisation or a distractor."""

    name: str
    born_city: str
    born_year: int
    profession: str


@dataclass(frozen=True)
class Organisation:
    """An invented organisation with a founder (a `Person`), founding year and seat."""

    name: str
    founded: int
    city: str
    founder: Person


def generate(
    seed: int, n: int, passages: int, passage_tokens: int, path: str | Path | None = None
) -> list[dict[str, Any]]:
    """Generate `n` CacheBlend-JSON examples with `passages` passages of about `passage_tokens`
    SmolLM2 tokens each; the same seed always gives the same output. Writes the list to `path`
    as JSON when given (creating parent folders) and returns it.

    Questions cycle through founding year (1 hop), a person's birthplace (1 hop), the
    founder's birthplace (2 hops) and the founder's birth year (2 hops).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if passages < 2:
        raise ValueError(f"passages must be >= 2 (a two-hop question needs two passages), got {passages}")
    if passage_tokens < 16:
        raise ValueError(f"passage_tokens must be >= 16 so the facts fit, got {passage_tokens}")
    examples = [_example(random.Random(seed * 1_000_003 + i), f"synthetic-{seed}-{i}", i % 4, passages, passage_tokens) for i in range(n)]
    if path is not None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(examples, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return examples


class _Names:
    """Unique invented names within one example."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) for _ in range(syllables)]
            word = "".join(parts).capitalize()
            if word not in self.used:
                self.used.add(word)
                return word

    def person(self, surname: str | None = None) -> str:
        return f"{self.word(2)} {surname or self.word(2)}"

    def city(self) -> str:
        return self.word(1) + self.rng.choice(_CITY_ENDINGS)


def _person(rng: random.Random, names: _Names, avoid: Person | None = None, surname: str | None = None) -> Person:
    while True:
        person = Person(names.person(surname), names.city(), rng.randint(1780, 1900), rng.choice(_PROFESSIONS))
        if avoid is None or (person.born_city != avoid.born_city and person.born_year != avoid.born_year):
            return person


def _organisation(rng: random.Random, names: _Names, founder: Person, kind: str, avoid: Organisation | None = None) -> Organisation:
    while True:
        org = Organisation(f"the {names.word(2)} {kind}", founder.born_year + rng.randint(25, 60), names.city(), founder)
        if avoid is None or org.founded != avoid.founded:
            return org


def _example(rng: random.Random, example_id: str, kind: int, n_passages: int, passage_tokens: int) -> dict[str, Any]:
    names = _Names(rng)
    org_kind = rng.choice(_ORG_KINDS)
    founder = _person(rng, names)
    target = _organisation(rng, names, founder, org_kind)
    # Look-alikes: same kind of organisation, a founder sharing the real founder's surname.
    twin_founder = _person(rng, names, avoid=founder, surname=founder.name.split()[1])
    twin = _organisation(rng, names, twin_founder, org_kind, avoid=target)
    entities: list[Organisation | Person] = [target, founder, twin, twin_founder]
    while len(entities) < n_passages:
        other_founder = _person(rng, names, avoid=founder)
        entities.append(_organisation(rng, names, other_founder, rng.choice(_ORG_KINDS), avoid=target))
        if len(entities) < n_passages:
            entities.append(other_founder)
    entities = entities[:n_passages]
    if kind == 0:
        question, answer, hops = f"In what year was {target.name} founded?", str(target.founded), 1
    elif kind == 1:
        question, answer, hops = f"In which city was {founder.name} born?", founder.born_city, 1
    elif kind == 2:
        question, answer, hops = f"In which city was the founder of {target.name} born?", founder.born_city, 2
    else:
        question, answer, hops = f"In what year was the founder of {target.name} born?", str(founder.born_year), 2
    order = list(range(len(entities)))
    rng.shuffle(order)
    budget = int(passage_tokens * CHARS_PER_TOKEN)
    ctxs = [_passage(rng, entities[i], budget) for i in order]
    return {
        "id": example_id,
        "question": _capitalise(question),
        "answers": [answer],
        "hops": hops,
        "ctxs": ctxs,
    }


def _capitalise(text: str) -> str:
    return text[0].upper() + text[1:]


def _passage(rng: random.Random, entity: Organisation | Person, budget: int) -> dict[str, str]:
    """One passage: an opening fact sentence, filler from templates up to `budget` characters,
    and any further fact sentences at random places among the filler."""
    if isinstance(entity, Organisation):
        title = _capitalise(entity.name).removeprefix("The ")
        opening = f"{_capitalise(entity.name)} was founded in {entity.founded} by the {entity.founder.profession} {entity.founder.name}."
        later = [f"The seat of {entity.name} has always been in the city of {entity.city}."]
        templates, fill = _ORG_FILLER, {"name": entity.name, "profession": ""}
    else:
        title = entity.name
        opening = f"{entity.name} was a {entity.profession} born in {entity.born_year} in the city of {entity.born_city}."
        later = []
        templates, fill = _PERSON_FILLER, {"name": entity.name, "profession": entity.profession}
    filler: list[str] = []
    length = len(opening) + sum(len(s) + 1 for s in later)
    deck: list[str] = []
    while length < budget:
        if not deck:  # cycle through every template before repeating one
            deck = list(templates)
            rng.shuffle(deck)
        adj, adj2 = rng.sample(_ADJECTIVES, 2)
        sentence = _capitalise(deck.pop().format(adj=adj, adj2=adj2, things=rng.choice(_THINGS), **fill))
        if filler and length + len(sentence) + 1 > budget * 1.05:
            break
        filler.append(sentence)
        length += len(sentence) + 1
    for fact in later:
        filler.insert(rng.randint(0, len(filler)), fact)
    return {"title": title, "text": " ".join([opening, *filler])}


def main(argv: list[str] | None = None) -> None:
    """Command line: write a synthetic set as CacheBlend JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", type=int, default=24, help="number of examples")
    parser.add_argument("--passages", type=int, default=6, help="passages per example")
    parser.add_argument("--passage-tokens", type=int, default=500, help="approximate SmolLM2 tokens per passage")
    parser.add_argument("--out", required=True, help="output JSON path")
    args = parser.parse_args(argv)
    examples = generate(args.seed, args.n, args.passages, args.passage_tokens, args.out)
    print(json.dumps({"path": args.out, "examples": len(examples), "passages": args.passages}))


if __name__ == "__main__":
    main()
