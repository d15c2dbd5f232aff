"""Prompts for the speculation benchmarks (bench/speculation.py, bench/determinism.py): several of each
workload, so that each repetition sends text neither server has seen before (a pool of n-grams kept
across requests would otherwise measure the repetition, not the workload).

Each passage and function is long enough (150-200 tokens) that a 120-token answer copying it is a copy
from its first token to its last.
"""

from __future__ import annotations

PASSAGES = (
    "The river rose through the night, and by morning the low fields were a grey sheet of water. Farmers moved "
    "their animals to the ridge, while the ferryman tied his boat to the old oak and waited for the rain to stop. "
    "By noon the bridge at the mill was under water, and the children of the village watched from the church steps "
    "as fence posts, baskets and a wooden chair floated past. The miller's wife carried bread and cheese up the hill "
    "for anyone who had left home without breakfast. Nobody could remember a flood like it, although the oldest "
    "woman said her grandmother had spoken of one when the king was still a boy. In the evening the rain finally "
    "stopped, the clouds broke apart, and a thin red sun came out over the drowned meadows.",
    "The lighthouse stood on a rock a mile from the harbour, and for forty years the same family had kept its lamp "
    "burning. Every evening the keeper climbed the hundred and twelve steps, trimmed the wick and wound the clock "
    "that turned the great lens. In winter the spray reached the gallery, and ice had to be chipped from the glass "
    "before dawn. Supplies came by boat once a fortnight when the sea allowed it, and in bad years the family lived "
    "for weeks on salted fish, potatoes and tea. When the light was finally made automatic, the last keeper rowed "
    "ashore with two suitcases and never went back. His daughter still keeps the logbooks, in which every storm, "
    "every ship and every broken pane of glass is written down in the same careful hand.",
    "Making bread at home takes patience more than skill. Mix the flour, water, salt and a little yeast into a rough "
    "dough, then leave it covered for half an hour so the flour can drink the water. Stretch and fold the dough every "
    "thirty minutes for two hours, and you will feel it turn smooth and elastic under your hands. Shape it into a "
    "round loaf, let it rise in a floured basket overnight in the fridge, and bake it in a very hot covered pot. "
    "Take the lid off for the last fifteen minutes so the crust turns deep brown, and wait an hour before you cut it. "
    "If the loaf comes out flat, the dough was too wet or rose too long; use a little less water the next time.",
    "The old railway line was closed in the spring of the year the factory shut, and for a decade the tracks rusted "
    "among the nettles. Then a group of volunteers began to clear the path, one weekend at a time, with borrowed "
    "tools and a great deal of tea. They rebuilt two small bridges, laid gravel over the sleepers and planted apple "
    "trees where the stations had been. Today the line is a footpath and cycle route twelve miles long, and on summer "
    "evenings it is busy with families, runners and a retired driver who still walks it every day. He likes to tell "
    "anyone who will listen where the signal box stood, and how long the morning train took to reach the coast.",
    "Our meeting on Tuesday agreed three things. First, the new warehouse will open on the first of March, a month "
    "later than planned, because the roof inspection found damaged panels that must be replaced. Second, the two "
    "delivery teams will merge under one manager, and each driver will keep their current routes until the summer. "
    "Third, the budget for training will double next year, with the extra money spent on safety courses for every "
    "member of staff who handles the forklifts. Fourth, the canteen will stay open until eight on weekdays, and the "
    "car park by the gate will be resurfaced in April. The next meeting is on the fourteenth, and minutes will be "
    "sent round by Friday.",
)

FUNCTIONS = (
    '''def average(values):
    x = 0
    count = 0
    for value in values:
        if value is None:
            continue
        x += value
        count += 1
    if count == 0:
        return 0.0
    return x / count


def spread(values):
    low = min(values)
    high = max(values)
    return high - low


def middle(values):
    ordered = sorted(values)
    half = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) / 2
''',
    '''def word_counts(text):
    x = {}
    for line in text.splitlines():
        for word in line.split():
            word = word.strip(".,;:!?").lower()
            if not word:
                continue
            x[word] = x.get(word, 0) + 1
    return x


def most_common(text, n):
    counts = word_counts(text)
    return sorted(counts.items(), key=lambda item: -item[1])[:n]


def print_table(text, n):
    for word, count in most_common(text, n):
        print(f"{word:<20} {count:>6}")
''',
    '''class Stack:
    def __init__(self):
        self.x = []

    def push(self, item):
        self.x.append(item)

    def pop(self):
        if not self.x:
            raise IndexError("pop from an empty stack")
        return self.x.pop()

    def peek(self):
        if not self.x:
            return None
        return self.x[-1]

    def __len__(self):
        return len(self.x)

    def clear(self):
        self.x = []

    def __repr__(self):
        return f"Stack({self.x!r})"
''',
    '''def read_settings(path):
    x = {}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected name = value")
            name, value = line.split("=", 1)
            x[name.strip()] = value.strip()
    return x


def setting(path, name, default=None):
    values = read_settings(path)
    if name not in values:
        return default
    return values[name]
''',
    '''def merge_sorted(left, right):
    x = []
    i = 0
    j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            x.append(left[i])
            i += 1
        else:
            x.append(right[j])
            j += 1
    x.extend(left[i:])
    x.extend(right[j:])
    return x


def merge_sort(items):
    if len(items) <= 1:
        return list(items)
    half = len(items) // 2
    return merge_sorted(merge_sort(items[:half]), merge_sort(items[half:]))
''',
)

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a baker who opens a shop in a town where nobody eats bread",
    "two children who build a raft to cross a lake",
    "an old clockmaker whose clocks all stop at the same minute",
    "a postman who delivers letters to a village in the mountains",
)

WORKLOADS = {
    "copy": [f"Copy this passage exactly, word for word:\n\n{p}" for p in PASSAGES],
    "edit": [f"Rewrite this Python code with the variable x renamed to total, and change nothing else:\n\n{f}"
             for f in FUNCTIONS],
    "quote": [f"Here is a passage:\n\n{p}\n\nQuote its first two sentences, then say in your own words what "
              f"happened next." for p in PASSAGES],
    "prose": [f"Write a short story about {topic}." for topic in TOPICS],
}
"""Each workload's prompts, one per repetition (they repeat after five)."""
