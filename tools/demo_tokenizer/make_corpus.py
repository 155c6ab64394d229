"""Generate ``corpus.txt``: the project's own English text for training the demo tokenizer.

Everything here is original text written for hyprefix: hand-written paragraphs plus
seeded template expansions (prose, dialogues, code, logs, config files). The output is
deterministic. Run: ``python tools/demo_tokenizer/make_corpus.py`` (it writes
``tools/demo_tokenizer/corpus.txt``, next to this script).
"""

from __future__ import annotations

import random
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 190_000

PARAGRAPHS = [
    "An inference engine takes a trained model and turns it into a service. The model "
    "itself is only a large collection of numbers; the engine decides how requests are "
    "scheduled, how memory is shared between them, and how quickly the first token "
    "reaches the user.",
    "Most of the time spent generating text is not spent on the prompt. The prompt is "
    "processed in one large batch, which keeps the arithmetic units busy. The slow part "
    "is decoding, where each new token needs the whole model to be read from memory "
    "again while doing very little math per byte.",
    "A key-value cache stores the attention keys and values of every token that has "
    "already been processed. Without it, the model would recompute the entire history "
    "for each new token, and the cost of a long conversation would grow quadratically.",
    "Prefix caching goes one step further. When two requests begin with the same system "
    "prompt, the engine can reuse the cached keys and values of that shared prefix "
    "instead of computing them twice. In a chat service where thousands of users share "
    "one long instruction block, this saves a surprising amount of work.",
    "To find shared prefixes quickly, many engines split the cache into fixed-size "
    "blocks and give each block a hash that depends on its tokens and on the hash of the "
    "block before it. Two sequences that agree on the first hundred tokens will then "
    "agree on the first few block hashes, and a simple dictionary lookup is enough.",
    "Hybrid models mix ordinary attention layers with recurrent or state-space layers. "
    "The recurrent layers keep a fixed-size state instead of a growing cache, which is "
    "cheap for long inputs but makes prefix reuse harder: you cannot cut a state in the "
    "middle, so you must save snapshots at the points you might want to resume from.",
    "Paged memory management borrows an old idea from operating systems. Instead of "
    "reserving one contiguous region per request, the engine hands out small pages on "
    "demand and keeps a table that maps logical positions to physical pages. Fragmentation "
    "drops, and more requests fit on the same device.",
    "Continuous batching lets new requests join a running batch as soon as an old one "
    "finishes, rather than waiting for the slowest member of a fixed batch. The scheduler "
    "runs every step, checks which sequences are done, and fills the empty slots.",
    "Speculative decoding uses a small, fast draft model to guess several tokens ahead. "
    "The large model then checks all of the guesses in a single forward pass and keeps "
    "the longest prefix it agrees with. When the guesses are good, several tokens are "
    "produced for the price of one.",
    "Quantization stores weights with fewer bits, for example eight or four bits per value "
    "instead of sixteen. The model becomes smaller and decoding gets faster because less "
    "data has to move, but careless quantization can hurt quality, especially for "
    "outlier channels.",
    "A tokenizer converts text into integer ids. Byte-level tokenizers start from the 256 "
    "possible byte values, so they can encode any string at all, including emoji, "
    "accented letters and Chinese characters, without an unknown token.",
    "Byte pair encoding builds its vocabulary by repeatedly merging the most frequent "
    "pair of adjacent symbols. Early merges join common letter pairs such as t and h; "
    "later merges produce whole words like the, and, cache and model.",
    "Every computer has a memory hierarchy. Registers are tiny and fast, caches are "
    "larger and a little slower, main memory is larger still, and disks are huge but "
    "slow. Good programs keep the data they need next as close to the processor as "
    "possible.",
    "A cache hit means the data was found where we hoped; a cache miss means we have to "
    "go further away to fetch it. The hit rate matters more than almost any other number "
    "when you tune a caching system, because misses are often a hundred times slower.",
    "Eviction policies decide what to throw away when a cache is full. Least recently "
    "used is the classic choice: drop whatever has not been touched for the longest time. "
    "It is simple, it works well in practice, and it is easy to explain to a colleague.",
    "On Saturday mornings the market opens early. The baker sells bread that is still "
    "warm, the farmer next to him sells tomatoes, onions and small green peppers, and by "
    "ten o'clock the line for coffee reaches the fountain in the middle of the square.",
    "My neighbour grows beans along the fence every summer. She says the trick is to "
    "water them in the evening, not at noon, and to pick them often so the plant keeps "
    "producing. By August there are more beans than either of us can eat.",
    "The train was late again, so I read a few chapters of my book on the platform. It "
    "was a quiet story about a lighthouse keeper who writes letters he never sends. When "
    "the train finally arrived, I almost wished it had taken a little longer.",
    "Cooking rice is easy once you stop lifting the lid. Rinse the grains, add water, "
    "bring it to a boil, then turn the heat down low and wait. After fifteen minutes, "
    "take the pot off the stove and let it rest for five more.",
    "A good bug report says what you did, what you expected, and what happened instead. "
    "It includes the version, the exact error message and, if possible, a short script "
    "that reproduces the problem. Such a report is often half of the fix.",
    "When the weather turns cold, the cat sleeps on the radiator shelf and refuses to "
    "move. She opens one eye when someone walks past, decides that nothing interesting is "
    "happening, and goes back to sleep.",
    "Unit tests should be fast and boring. A test that takes a minute will not be run "
    "often, and a test that depends on the network or the clock will fail at the worst "
    "possible moment. Keep the slow checks in a separate suite.",
    "Version control is a time machine for code. Each commit records what changed and "
    "why, so that months later you can find out when a behaviour appeared and who to ask "
    "about it. Write the message for the person who reads it next year.",
    "The library on the corner has a small room full of old maps. Some of them show "
    "rivers that have since moved and villages that no longer exist. On rainy afternoons "
    "it is one of the calmest places in the whole city.",
    "Greedy decoding always picks the most likely next token. It is deterministic, which "
    "makes it ideal for tests, but it can get stuck repeating the same phrase. Sampling "
    "with a temperature adds variety at the cost of reproducibility.",
    "Top-p sampling, sometimes called nucleus sampling, keeps the smallest set of tokens "
    "whose probabilities add up to p and samples only from that set. It adapts to the "
    "shape of the distribution better than a fixed top-k cut-off.",
    "Latency is how long one request waits; throughput is how many requests finish per "
    "second. The two pull in different directions. Bigger batches raise throughput but "
    "make each individual request wait a little longer.",
    "Rotary position embeddings encode the position of a token by rotating pairs of "
    "dimensions in the query and key vectors. Because the rotation angle grows with the "
    "position, the dot product between two tokens depends on their distance.",
    "Grouped-query attention lets several query heads share one key head and one value "
    "head. The cache becomes several times smaller, which matters a lot when sequences "
    "are long and memory is the bottleneck.",
    "Before a long hike, check the forecast, pack more water than you think you need, and "
    "tell someone where you are going. A paper map weighs almost nothing and never runs "
    "out of battery.",
    "The old laptop still works, but the fan is loud and the battery lasts about forty "
    "minutes. I use it as a small home server now: it backs up photos every night and "
    "serves a page that shows the temperature in the greenhouse.",
    "Floating point numbers are approximations. Adding a tiny number to a huge one can "
    "lose the tiny number completely, and summing the same values in a different order "
    "can give a slightly different result. Deterministic kernels fix the order.",
    "The bfloat16 format keeps the eight exponent bits of a 32-bit float but only seven "
    "bits of mantissa. It covers the same range of values with less precision, which "
    "suits neural network weights surprisingly well.",
    "A scheduler that only looks at arrival order can starve long requests or let one "
    "huge prompt block everyone else. Chunked prefill splits a long prompt into pieces so "
    "that decoding steps for other users can run in between.",
    "Our team keeps a simple rule: measure before optimizing. A profiler often shows that "
    "the slow part is not where anyone guessed, and a ten line change in the right place "
    "beats a thousand lines in the wrong one.",
    "On the first day of spring the park fills with people. Children chase pigeons, old "
    "friends play chess on the stone tables, and someone always brings a guitar and plays "
    "the same three songs until sunset.",
    "If a program crashes only on Tuesdays, look for dates. If it crashes only on one "
    "machine, look for the environment. If it crashes only when you are not watching, "
    "add logging and wait patiently.",
    "The recipe calls for two cups of flour, one teaspoon of salt, a spoon of honey and "
    "warm water. Mix, knead for ten minutes, cover the bowl with a towel and let the "
    "dough rise until it has doubled in size.",
    "A snapshot of a recurrent state is just a copy of a few tensors taken at a chosen "
    "position. Restoring it means copying them back and continuing from the next token. "
    "The hard part is deciding which positions deserve a snapshot.",
    "Memory bandwidth, not raw compute, limits most decoding workloads. A model with one "
    "billion parameters in sixteen-bit precision needs two gigabytes of reads for every "
    "token, no matter how clever the matrix multiplication is.",
    "Caf\u00e9 owners in the old town know their regulars by name. The na\u00efve tourist "
    "orders a large latte at four in the afternoon; the locals order a small espresso and "
    "stand at the counter for exactly three minutes.",
    "She fixed the bicycle herself: a new chain, two tubes and a little oil on the "
    "brakes. It took an afternoon and a few borrowed tools, and now the bike is quieter "
    "than it has been in years.",
    "Every request that reaches the server carries a few sampling settings: a temperature, "
    "a limit on new tokens, perhaps a list of stop strings. The engine copies them into a "
    "small structure that lives as long as the request and is thrown away when it ends.",
    "Stop strings are trickier than they look. A stop word may be split across two tokens, "
    "so the engine has to hold back a little text until it is sure the next token does "
    "not complete the forbidden phrase.",
    "Streaming responses send each piece of text as soon as it is ready. The client sees "
    "the answer appear word by word, which feels much faster even when the total time is "
    "exactly the same.",
    "Detokenization is not always one token to one string. Multi-byte characters such as "
    "\u00e9, \u4f60\u597d or an emoji may be spread over several byte-level tokens, and the "
    "engine must wait until the bytes form valid UTF-8 before printing them.",
    "A radix tree stores strings by their common prefixes. Each edge holds a run of "
    "tokens, and each node remembers which cached blocks belong to the path from the root. "
    "Looking up a new prompt means walking down the tree as far as it matches.",
    "Reference counting keeps shared blocks alive. When two requests point at the same "
    "block, its count is two; when both finish, the count drops to zero and the block can "
    "be recycled or kept in the cache for the next visitor.",
    "Copy-on-write lets two sequences share a block until one of them needs to change it. "
    "At that moment the engine makes a private copy, so the other sequence never sees the "
    "modification.",
    "Benchmarks need care. Warm up the model first, fix the random seed, record the "
    "hardware and the software versions, and report both the median and the worst case. "
    "A single number hides most of the story.",
    "The weekend forecast promised sunshine, so we packed sandwiches, a blanket and a "
    "kite. By noon the clouds had rolled in and the wind was far too strong for the kite, "
    "but the sandwiches were excellent.",
    "Learning a musical instrument as an adult is humbling. The fingers know what they "
    "should do a moment after the note was supposed to sound. Practice a little every day "
    "and the gap slowly closes.",
    "The bus stops outside the hospital, the school and the post office before it turns "
    "toward the harbour. In the early morning it is nearly empty; by eight it is full of "
    "students with heavy backpacks.",
    "Soup is the most forgiving meal. Start with onions in a little oil, add whatever "
    "vegetables are left in the fridge, cover them with water or stock, and let it simmer "
    "until everything is soft. Salt at the end.",
    "Passwords should be long, unique and stored in a password manager. Servers should "
    "never keep them in plain text; they store a slow, salted hash and compare hashes "
    "when someone logs in.",
    "A thread pool keeps a fixed number of worker threads waiting for jobs. Creating a "
    "thread is expensive, so reusing them saves time when many small tasks arrive at once.",
    "JSON is easy to read and easy to write, which is why so many configuration files "
    "use it. Its main weakness is that it has no comments, so people invent clever ways "
    "to hide notes inside strings.",
    "Our grandfather kept a notebook of every tree he planted, with the date, the place "
    "and the weather that day. Forty years later the notebook is thin and yellow, and the "
    "trees are taller than the house.",
    "Tensor shapes are the first thing to check when a model misbehaves. A batch dimension "
    "in the wrong place, a missing transpose or a silent broadcast can produce numbers "
    "that look reasonable and are completely wrong.",
    "Attention masks tell the model which positions it may look at. In a causal model each "
    "token sees itself and everything before it, never the future; padding positions are "
    "hidden from everyone.",
    "Sliding window attention limits each token to the most recent few thousand positions. "
    "Old entries can then be dropped from the cache, which keeps memory flat even for very "
    "long conversations.",
    "In the middle of the night the power went out. The fridge went quiet, the router "
    "lights went dark, and for a few minutes the whole street was silent except for a dog "
    "that seemed personally offended.",
    "A small model is a wonderful tool for testing. It loads in a fraction of a second, "
    "runs on any laptop, and exercises the same code paths as the real thing. Its answers "
    "are nonsense, but they are reproducible nonsense.",
    "Logging should answer the question you will have at three in the morning: what was "
    "the system doing, for which request, and how long did it take? Anything else is "
    "noise.",
]

TOPICS: dict[str, dict[str, list[str]]] = {
    "engine": {
        "subj": [
            "the scheduler", "the engine", "the cache manager", "the block allocator",
            "the tokenizer", "the model runner", "each worker", "the server",
            "the request queue", "the prefix tree", "the decoder", "the sampler",
            "the attention kernel", "the batch planner", "the memory pool",
        ],
        "verb": [
            "allocates", "frees", "reuses", "hashes", "schedules", "evicts", "copies",
            "streams", "checks", "records", "splits", "merges", "updates", "returns",
            "computes", "stores", "loads", "prefetches", "validates", "reports",
        ],
        "obj": [
            "a new block", "the shared prefix", "the cached keys and values",
            "every finished request", "the next token", "the logits", "a snapshot of the state",
            "the prompt tokens", "the attention mask", "the position ids",
            "the least recently used page", "a batch of sequences", "the output text",
            "the block table", "the sampling parameters", "the request metadata",
        ],
        "tail": [
            "before the next step", "when memory runs low", "after every decode step",
            "as soon as possible", "in a single forward pass", "without blocking other users",
            "only if the hash matches", "while the GPU is busy", "at the end of prefill",
            "for each layer of the model", "in constant time", "under heavy load",
        ],
    },
    "computer": {
        "subj": [
            "the processor", "the operating system", "the compiler", "the disk",
            "the network card", "the file system", "a background thread", "the kernel",
            "the garbage collector", "the database", "the web browser", "the laptop",
            "the build system", "the test runner", "the package manager",
        ],
        "verb": [
            "reads", "writes", "caches", "compresses", "sends", "receives", "indexes",
            "schedules", "optimizes", "logs", "encrypts", "restarts", "installs",
            "downloads", "compiles", "measures", "locks", "unlocks",
        ],
        "obj": [
            "the whole file", "a small packet", "the configuration", "every page of memory",
            "the latest version", "a temporary directory", "the user's password hash",
            "a list of dependencies", "the error message", "the system clock",
            "a large array of numbers", "the source code", "the network address",
        ],
        "tail": [
            "in the background", "every few seconds", "once per boot", "when the fan speeds up",
            "before shutting down", "on the second attempt", "with very little overhead",
            "after the update", "during the night", "if the cache is cold",
        ],
    },
    "daily": {
        "subj": [
            "my sister", "the old man next door", "our teacher", "the little boy",
            "a friendly dog", "the shop owner", "my grandmother", "the bus driver",
            "a group of students", "the gardener", "the new neighbour", "my best friend",
            "the cook", "the doctor", "a tired traveller",
        ],
        "verb": [
            "buys", "cooks", "paints", "visits", "cleans", "finds", "loses", "repairs",
            "carries", "plants", "reads", "writes", "sells", "borrows", "waters",
            "remembers", "forgets", "orders", "shares", "washes",
        ],
        "obj": [
            "fresh bread", "a red umbrella", "the kitchen window", "a long letter",
            "three apples", "the garden fence", "a cup of tea", "an old photograph",
            "the morning paper", "a pair of boots", "the blue bicycle", "a bag of rice",
            "the tomato plants", "a birthday cake", "the front door key",
        ],
        "tail": [
            "every Sunday", "before breakfast", "in the rain", "after school",
            "at the market", "near the river", "late in the evening", "on the way home",
            "with great care", "without saying a word", "for the whole family",
            "in the middle of winter", "just before sunset", "twice a week",
        ],
    },
}

ADJ = [
    "small", "large", "quick", "slow", "quiet", "bright", "careful", "simple", "useful",
    "strange", "familiar", "important", "warm", "cold", "modern", "ancient", "efficient",
    "reliable", "noisy", "gentle", "expensive", "cheap", "heavy", "light", "clever",
]

CONNECT = [
    "Meanwhile,", "However,", "In practice,", "Usually,", "Sometimes", "Of course,",
    "After that,", "For example,", "In the end,", "Surprisingly,", "As a result,",
    "Later,", "Still,", "Then", "At first,", "Most of the time,",
]

QUESTIONS = [
    "What is a key-value cache?",
    "Why is decoding slower than prefill?",
    "How do I boil an egg?",
    "Can you explain prefix caching in simple words?",
    "What should I pack for a weekend trip?",
    "How does a hash table work?",
    "What is the difference between latency and throughput?",
    "Why does my program run out of memory?",
    "How often should I water a basil plant?",
    "What does a tokenizer do?",
    "Is it going to rain tomorrow?",
    "How can I make my tests faster?",
    "What is grouped-query attention?",
    "Can you suggest a name for a grey cat?",
    "How do I reverse a list in Python?",
    "What is the capital of France?",
    "Why do computers use binary numbers?",
    "How many minutes are in a day?",
]

ANSWERS = [
    "It stores the attention keys and values of earlier tokens so they are not computed again.",
    "Prefill processes many tokens at once, while decoding produces one token per step and "
    "is limited by memory bandwidth.",
    "Put the egg in boiling water for about seven minutes, then cool it in cold water.",
    "If many requests start with the same text, the engine computes that text once and "
    "reuses the result for all of them.",
    "Bring comfortable shoes, a warm jacket, a charger, and a book for the train.",
    "It turns a key into a number, uses that number to pick a bucket, and stores the "
    "value there so it can be found quickly.",
    "Latency is the time one request takes; throughput is how much work finishes per second.",
    "It may keep references to large objects, or it may load more data than it needs at once.",
    "Water it when the top of the soil feels dry, usually every two or three days in summer.",
    "It splits text into pieces and maps each piece to an integer id the model understands.",
    "I cannot see the sky from here, but a weather service will have a forecast for your town.",
    "Run them in parallel, avoid sleeping, and replace slow external services with fakes.",
    "Several query heads share one key and value head, which makes the cache smaller.",
    "How about Pepper, Smoke, Ash, or Misty?",
    "Use reversed(items) for an iterator or items[::-1] for a new list.",
    "The capital of France is Paris.",
    "Binary has only two states, which are easy to represent with switches that are on or off.",
    "There are 1440 minutes in a day.",
]

def _words(text: str) -> list[str]:
    return text.split()


NOUNS = _words(
    """
apple afternoon airport album animal answer apartment argument army article artist
audience autumn baby backpack bakery balcony ball band bank basket battery beach bean
bear bed bedroom bell bench bird birthday blanket boat body bone book bottle bowl box
branch bread breakfast bridge brother brush bucket budget building bus butter button
cabinet cable cake calendar camera candle canoe captain card carpet carrot castle cat
ceiling chair chapter cheese chef cherry chicken child chimney church circle city class
classroom cliff clock cloud coast coat coffee coin collar colour column comment company
computer concert corner cottage country cousin cow crowd cup curtain customer cycle
dance daughter desert desk diary dinner direction doctor document dog door dragon drawer
dream dress driver drum duck eagle ear earth egg elbow elephant engine engineer envelope
evening event exam factory family farm farmer father feather fence festival field film
finger fire fish flag flight floor flower forest fork fountain fox friend frog fruit
garage garden gate gift glass glove goat grape grass guitar hair hall hammer hand
harbour hat head heart helmet hill history holiday home horse hospital hotel house idea
island jacket jar journey judge juice kettle key kitchen kite knee knife ladder lake
lamp language lawyer leaf lemon lesson letter library light lion list lunch machine
magazine map market meadow meal memory message metal minute mirror moment money monkey
month moon morning mother mountain mouse mouth movie museum music nail neighbour nest
newspaper night noise notebook number ocean office onion orange oven owl page painter
palace pan paper parent park party passenger path pencil pepper person phone photo piano
picture pillow pilot planet plate playground pocket poem pond potato pupil puzzle queen
question rabbit radio rain recipe river road rock roof room rope rule sail salad sand
sandwich scarf school scientist screen sea season seed shadow sheep shelf ship shirt
shoe shop shoulder singer sister sky sleeve snow soap sock soldier song soup spoon
spring square stair star station stone storm story street student sugar suitcase summer
sun supper table tail teacher teapot tent theatre thunder ticket tiger toast tomato
tongue tool tooth tower town toy tractor train tree truck tunnel umbrella uncle valley
vegetable village violin voice wall wallet watch water wave week wheel window winter
wolf wood word worker world writer yard year zebra algorithm array benchmark bottleneck
bytecode checkpoint cluster compiler container database debugger deployment directory
driver endpoint exception framework function gateway gradient graph handler hardware
interface interpreter kernel keyboard laptop library matrix microphone module monitor
network operator parameter pipeline pointer printer process processor protocol register
repository router runtime sensor server socket software storage terminal thread
timestamp transaction variable vector website
"""
)

IRREGULAR_PLURALS = {
    "child": "children", "mouse": "mice", "person": "people", "tooth": "teeth",
    "knife": "knives", "leaf": "leaves", "wolf": "wolves", "sheep": "sheep",
    "fish": "fish", "shelf": "shelves", "index": "indices", "matrix": "matrices",
}

VERBS = _words(
    """
accept add admire agree allow answer appear arrange arrive ask bake believe belong
borrow brush call carry change chase check clean climb close collect compare complain
cook copy count cover crawl cross cry dance decide deliver describe design destroy
discover dream dress drop enjoy enter explain fill finish fix fold follow gather greet
guess hammer hand happen hate help hope hurry imagine improve include invent invite jump
kick kiss knock land laugh learn lift like listen live look love manage mark marry
measure melt mention miss move need notice offer open order paint park pass pick plan
plant play point pour practise prefer prepare press print promise pull push reach record
relax remember repair repeat reply rescue return rush save search serve share shout
smile sort start stay step stop study suggest surprise talk taste test thank touch
travel try turn unlock use visit wait walk want wash watch water whisper wish wonder
work worry wrap yawn
"""
)

IRREGULAR_VERBS = {
    "begin": "began", "bring": "brought", "build": "built", "buy": "bought",
    "catch": "caught", "choose": "chose", "come": "came", "draw": "drew", "drink": "drank",
    "drive": "drove", "eat": "ate", "fall": "fell", "feel": "felt", "fight": "fought",
    "find": "found", "fly": "flew", "forget": "forgot", "freeze": "froze", "get": "got",
    "give": "gave", "go": "went", "grow": "grew", "hang": "hung", "hear": "heard",
    "hide": "hid", "hold": "held", "keep": "kept", "know": "knew", "leave": "left",
    "lend": "lent", "lose": "lost", "make": "made", "meet": "met", "pay": "paid",
    "read": "read", "ride": "rode", "ring": "rang", "rise": "rose", "run": "ran",
    "say": "said", "see": "saw", "sell": "sold", "send": "sent", "sing": "sang",
    "sit": "sat", "sleep": "slept", "speak": "spoke", "spend": "spent", "stand": "stood",
    "steal": "stole", "swim": "swam", "take": "took", "teach": "taught", "tell": "told",
    "think": "thought", "throw": "threw", "understand": "understood", "wake": "woke",
    "wear": "wore", "win": "won", "write": "wrote",
}

ADJECTIVES = _words(
    """
able angry anxious ancient beautiful bitter black blue bold brave bright broad broken
brown busy calm careful charming cheap cheerful clean clear clever cloudy clumsy cold
colourful comfortable common cool crazy crisp curious damp dark deep delicate delicious
different difficult dirty dry dull dusty early easy elegant empty enormous entire equal
exact excellent expensive faint fair famous fancy fast fierce flat fragile free fresh
friendly full funny gentle giant glad golden good graceful grateful great green grey
happy hard healthy heavy helpful high hollow honest hot huge humble hungry icy ideal
important innocent jolly kind large late lazy light little lively lonely long loud
lovely low lucky magic mighty mild modern narrow nasty natural neat nervous new nice
noisy normal odd old open orange ordinary pale patient perfect plain pleasant polite
poor popular powerful precious pretty proud purple quick quiet rapid rare raw ready real
red rich right rough round rude sad safe salty scary sharp shiny short shy silent silly
simple sleepy slow small smooth soft solid sour spicy splendid square steady steep
sticky strange strict strong sudden sunny super sweet swift tall tame tender thick thin
thirsty tidy tiny tired tough tricky ugly unusual useful vast violet warm weak wealthy
wet white whole wide wild windy wise wooden worried yellow young
"""
)

ADVERBS = _words(
    """
quickly slowly carefully quietly happily sadly suddenly finally often rarely usually
always never sometimes gently loudly badly easily simply nearly almost really truly
eagerly patiently politely proudly angrily bravely calmly cheerfully clumsily eventually
honestly lazily nervously openly partly secretly seriously silently smoothly softly
"""
)

PEOPLE = _words(
    """
Anna Ben Clara David Elena Farid Grace Hugo Ines Jonas Kira Leo Maya Nils Olga Pablo
Quinn Rosa Samir Tara Umar Vera Will Xenia Yusuf Zoe Amir Bea Carlos Dina Emil Freya
"""
)

CITIES = _words(
    """
Amsterdam Berlin Cairo Dublin Edinburgh Florence Geneva Helsinki Istanbul Jakarta Kyoto
Lisbon Madrid Nairobi Oslo Prague Quebec Rome Seoul Toronto Utrecht Vienna Warsaw Zurich
"""
)

PLACES = """
in the kitchen|at the station|under the bridge|near the lake|behind the library|
on the roof|inside the museum|across the valley|along the coast|by the fountain|
at the top of the hill|in the old harbour|next to the bakery|on the balcony|
in the server room|at the back of the classroom|beside the river|in the forest
""".replace("\n", "").split("|")

TIMES = """
yesterday|last summer|this morning|every autumn|on Monday|on Friday evening|
at midnight|in March|at half past seven|two days ago|next week|in the spring of 1998|
on the 3rd of June|around noon|after dinner|during the storm|at dawn|since January
""".replace("\n", "").split("|")


def _plural(noun: str) -> str:
    if noun in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[noun]
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def _past(verb: str) -> str:
    if verb in IRREGULAR_VERBS:
        return IRREGULAR_VERBS[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    if verb in {"drop", "plan", "stop", "step", "hug", "shop", "chat"}:
        return verb + verb[-1] + "ed"
    return verb + "ed"


def _ing(verb: str) -> str:
    if verb in {"drop", "plan", "stop", "step", "run", "swim", "sit", "win", "get", "begin", "forget"}:
        return verb + verb[-1] + "ing"
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith(("ee", "ye")):
        return verb[:-1] + "ing"
    return verb + "ing"


def _third(verb: str) -> str:
    if verb in {"go", "do"}:
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    if verb.endswith(("s", "x", "ch", "sh", "z")):
        return verb + "es"
    return verb + "s"


ALL_VERBS = VERBS + list(IRREGULAR_VERBS)


QUANTITIES = ["two", "three", "several", "many", "a few", "twelve", "some"]


def _np(rng: random.Random) -> str:
    noun = rng.choice(NOUNS)
    r = rng.random()
    if r < 0.08:
        return rng.choice(PEOPLE)
    if r < 0.3:
        return f"the {rng.choice(ADJECTIVES)} {noun}"
    if r < 0.5:
        return f"{rng.choice(QUANTITIES)} {_plural(noun)}"
    if r < 0.65:
        article = "an" if noun[0] in "aeiou" else "a"
        return f"{article} {noun}"
    if r < 0.8:
        return f"my {noun}"
    return f"the {noun}"


def _story_sentence(rng: random.Random) -> str:
    subj, obj = _np(rng), _np(rng)
    verb = rng.choice(ALL_VERBS)
    form = rng.randrange(8)
    if form == 0:
        s = f"{_cap(subj)} {_past(verb)} {obj} {rng.choice(PLACES)}."
    elif form == 1:
        be = "were" if subj.split()[0] in QUANTITIES or (subj.split()[0] == "a" and "few" in subj) else "was"
        s = f"{_cap(rng.choice(TIMES))}, {subj} {be} {_ing(verb)} {obj}."
    elif form == 2:
        s = f"{_cap(subj)} {rng.choice(ADVERBS)} {_past(verb)} {obj}, and nobody noticed."
    elif form == 3:
        s = f"Did {subj} {verb} {obj} {rng.choice(TIMES)}?"
    elif form == 4:
        s = (f"I think {subj} will {verb} {obj} because it is "
             f"{rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}.")
    elif form == 5:
        s = f"{_cap(_ing(verb))} {obj} is {rng.choice(['easy', 'hard', 'fun', 'boring', 'slow'])} {rng.choice(PLACES)}."
    elif form == 6:
        who, city = rng.choice(PEOPLE), rng.choice(CITIES)
        s = (f"{who} moved to {city} {rng.choice(TIMES)} and {_past(rng.choice(ALL_VERBS))} "
             f"{_np(rng)} {rng.choice(PLACES)}.")
    else:
        s = f"She {_third(verb)} {obj} {rng.choice(ADVERBS)}, but he never {_third(rng.choice(ALL_VERBS))} {_np(rng)}."
    return s


def _story(rng: random.Random) -> str:
    return " ".join(_story_sentence(rng) for _ in range(rng.randint(3, 7)))


NAMES = [
    "cache", "block", "request", "token", "batch", "page", "prefix", "state", "queue",
    "buffer", "config", "model", "layer", "tensor", "result", "item", "node", "entry",
    "worker", "stream", "seq", "slot", "index", "value", "key", "user", "record",
]

VERBS_CODE = [
    "get", "set", "load", "save", "build", "parse", "update", "reset", "find", "add",
    "remove", "compute", "check", "make", "read", "write", "alloc", "free", "hash", "split",
]

CODE_TEMPLATES = [
    '''def {v}_{n}(self, {a}: int) -> {T}:
    """{Doc}."""
    if {a} < 0:
        raise ValueError(f"{a} must be non-negative, got {{{a}}}")
    return self._{n}s[{a}]
''',
    '''def {v}_{n}s({a}s: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {{}}
    for {a} in {a}s:
        counts[{a}] = counts.get({a}, 0) + 1
    return counts
''',
    '''class {N}Manager:
    def __init__(self, capacity: int = {k}) -> None:
        self.capacity = capacity
        self.{n}s: dict[str, int] = {{}}

    def __len__(self) -> int:
        return len(self.{n}s)

    def {v}(self, name: str) -> int | None:
        return self.{n}s.get(name)
''',
    '''for i, {n} in enumerate({n}s):
    if {n} is None:
        continue
    total += len({n})
    print(f"{{i}}: {{{n}!r}}")
''',
    '''import torch

x = torch.randn({k}, {m})
w = torch.randn({m}, {k})
y = x @ w
print(y.shape, y.dtype)
''',
    '''with open("{n}s.json", "r", encoding="utf-8") as f:
    data = json.load(f)
{n}s = [item["{a}"] for item in data if item.get("enabled", True)]
''',
    '''async def {v}_{n}(client: Client, {a}: str) -> bytes:
    response = await client.get(f"/v1/{n}s/{{{a}}}")
    response.raise_for_status()
    return response.content
''',
    '''@dataclass
class {N}:
    {a}: int
    name: str = ""
    tokens: list[int] = field(default_factory=list)
''',
    '''if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
''',
    '''def hash_{n}(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens)) & 0xFFFFFFFF
''',
]

SHELL = [
    "$ pip install -e .",
    "$ python -m pytest -q tests/",
    "$ git log --oneline | head -n {k}",
    "$ ls -la ~/.cache/{n}",
    "$ du -sh /var/lib/{n}s",
    "$ curl -s http://localhost:{port}/v1/models",
    "$ export CUDA_VISIBLE_DEVICES=0",
    "$ grep -rn \"{v}_{n}\" src/",
    "$ python serve.py --port {port} --max-batch {k}",
    "$ cat /proc/meminfo | grep MemFree",
]

LOG_LEVELS = ["INFO", "INFO", "INFO", "DEBUG", "WARNING", "ERROR"]
LOG_MSGS = [
    "scheduled {k} requests, {m} running, {j} waiting",
    "prefix cache hit rate {p:.1f}%",
    "allocated {k} blocks ({m} free)",
    "request {rid} finished in {ms} ms ({k} tokens)",
    "evicted {j} blocks from the prefix cache",
    "decode step took {ms} ms for batch size {k}",
    "loaded model weights in {s:.2f} s",
    "out of memory while allocating {m} MiB, retrying",
    "snapshot saved at position {k} for request {rid}",
]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _base(verb: str) -> str:
    if verb.endswith("ies"):
        return verb[:-3] + "y"
    if verb.endswith(("shes", "ches", "sses", "xes")):
        return verb[:-2]
    return verb.removesuffix("s")


def _sentence(rng: random.Random) -> str:
    t = TOPICS[rng.choice(list(TOPICS))]
    subj, verb, obj = rng.choice(t["subj"]), rng.choice(t["verb"]), rng.choice(t["obj"])
    tail = rng.choice(t["tail"])
    form = rng.randrange(6)
    if form == 0:
        s = f"{_cap(subj)} {verb} {obj} {tail}."
    elif form == 1:
        s = f"{rng.choice(CONNECT)} {subj} {verb} {obj}."
    elif form == 2:
        s = f"{_cap(tail)}, {subj} {verb} {obj}."
    elif form == 3:
        s = f"Why does {subj} {_base(verb)} {obj}?"
    elif form == 4:
        adj = rng.choice(ADJ)
        s = f"{_cap(subj)} is {adj}, so it {verb} {obj} {tail}."
    else:
        s = f"{_cap(subj)} {verb} {obj}, and {rng.choice(t['subj'])} {rng.choice(t['verb'])} {rng.choice(t['obj'])}."
    return s


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))


def _fill(rng: random.Random) -> dict[str, object]:
    n = rng.choice(NAMES)
    return {
        "n": n,
        "N": _cap(n),
        "v": rng.choice(VERBS_CODE),
        "a": rng.choice([x for x in NAMES if x != n]),
        "T": rng.choice(["int", "str", "bytes", "list[int]", "float", "bool"]),
        "Doc": f"Return the {n} at the given position",
        "k": rng.choice([2, 4, 8, 16, 32, 64, 128, 256, 1024]),
        "m": rng.choice([3, 5, 12, 48, 96, 512, 768, 4096]),
        "j": rng.randint(0, 40),
        "p": rng.uniform(0, 100),
        "rid": f"req-{rng.randint(1000, 9999)}",
        "ms": rng.randint(1, 900),
        "s": rng.uniform(0.1, 30),
        "port": rng.choice([8000, 8080, 5000, 9000]),
    }


def _code(rng: random.Random) -> str:
    return rng.choice(CODE_TEMPLATES).format(**_fill(rng))


def _shell(rng: random.Random) -> str:
    return "\n".join(rng.choice(SHELL).format(**_fill(rng)) for _ in range(rng.randint(2, 5)))


def _logs(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 8)):
        f = _fill(rng)
        h, mi, se = rng.randrange(24), rng.randrange(60), rng.randrange(60)
        msg = rng.choice(LOG_MSGS).format(**f)
        lines.append(f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {h:02d}:{mi:02d}:{se:02d} "
                     f"{rng.choice(LOG_LEVELS):<7} hyprefix.{f['n']}: {msg}")
    return "\n".join(lines)


def _dialogue(rng: random.Random) -> str:
    i = rng.randrange(len(QUESTIONS))
    user, bot = rng.choice([("User", "Assistant"), ("Q", "A"), ("Question", "Answer")])
    return f"{user}: {QUESTIONS[i]}\n{bot}: {ANSWERS[i]}"


def _config(rng: random.Random) -> str:
    f = _fill(rng)
    return (
        "{\n"
        f'  "name": "{f["n"]}-{f["v"]}",\n'
        f'  "max_batch_size": {f["k"]},\n'
        f'  "block_size": {rng.choice([16, 32, 64])},\n'
        f'  "enable_prefix_caching": {rng.choice(["true", "false"])},\n'
        f'  "dtype": "{rng.choice(["bfloat16", "float16", "float32"])}",\n'
        f'  "port": {f["port"]}\n'
        "}"
    )


def _list(rng: random.Random) -> str:
    t = TOPICS[rng.choice(list(TOPICS))]
    head = rng.choice(["Things to check:", "Steps:", "Notes:", "Shopping list:", "To do:"])
    items = rng.sample(t["obj"], k=rng.randint(3, 5))
    return head + "\n" + "\n".join(f"{j + 1}. {_cap(x)}" for j, x in enumerate(items))


def build(target: int = TARGET_BYTES, seed: int = SEED) -> str:
    rng = random.Random(seed)
    chunks = list(PARAGRAPHS)
    kinds = [_prose] * 4 + [_story] * 7 + [_code] * 3 + [_dialogue] * 2 + [_logs, _shell, _config, _list]
    size = sum(len(c.encode()) for c in chunks)
    while size < target:
        c = rng.choice(kinds)(rng)
        chunks.append(c)
        size += len(c.encode()) + 2
    rng.shuffle(chunks)
    return "\n\n".join(chunks) + "\n"


def main() -> None:
    out = Path(__file__).resolve().with_name("corpus.txt")
    out.write_text(build(), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
