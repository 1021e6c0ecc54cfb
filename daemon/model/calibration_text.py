"""The calibration text for activation-aware quantization (llmd.model.calibrate): a few short documents of different
kinds (prose, explanation, instructions, code, a chat), written for llmd. Changing it changes the quantized bytes, so
bump `llmd.model.calibrate.CALIBRATION` with it. The quality benchmark measures on a different text.
"""

DOCUMENTS = (
    """\
The lighthouse keeper kept a logbook for forty years. Every evening she climbed the spiral stairs, trimmed the wick,
polished the great lens and wrote down the weather: wind from the north-east, a heavy swell, three ships passing
before midnight. In winter the storms came one after another, and the spray reached the gallery windows a hundred
feet above the rocks. Her only company was a grey cat and the supply boat that came every second Thursday, when the
sea allowed it. When the light was finally automated, she packed the logbooks into two wooden crates and gave them
to the museum in the harbour town, where visitors still read her neat handwriting and wonder how anyone could stand
so much silence.""",
    """\
Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical energy. Inside the
chloroplasts, pigments such as chlorophyll absorb mostly red and blue light and reflect green, which is why leaves
look green to us. The absorbed energy splits water molecules, releasing oxygen, and drives the production of two
carrier molecules, ATP and NADPH. In a second stage, the Calvin cycle uses these carriers to fix carbon dioxide from
the air into sugars. Almost every food chain on Earth depends on this reaction, and the oxygen in the atmosphere is
largely its by-product, accumulated over more than two billion years.""",
    """\
How to repot a houseplant:
1. Choose a pot one size larger than the current one, with a drainage hole.
2. Water the plant a day before, so the root ball holds together.
3. Turn the plant upside down, support the stem between your fingers and tap the pot until it slides free.
4. Loosen circling roots gently and remove any that are dark and soft.
5. Add fresh potting mix to the new pot, set the plant at the same depth as before and fill the sides.
6. Water thoroughly and keep the plant out of direct sun for about a week.
Most plants prefer to be repotted in spring, when they start to grow again.""",
    """\
import json
from pathlib import Path


def load_settings(path: Path, defaults: dict) -> dict:
    \"\"\"Read a JSON settings file; missing keys fall back to the defaults.\"\"\"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return dict(defaults)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
    return {**defaults, **data}


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
""",
    """\
The committee met on Tuesday, 14 March, at 10:30. Present: the chair, the treasurer and four members; two sent
apologies. The treasurer reported a balance of 12,480 euros, up 6% on last year, mostly thanks to the summer fair.
The roof repair was estimated at 3,200 euros; the committee agreed to ask for two more quotes before deciding. A
member proposed moving the annual meeting to October so that more families could attend. After some discussion the
proposal was accepted by five votes to one. The next meeting will take place on 11 April.""",
    """\
Dear Ms. Okafor,

Thank you for your letter of 2 June and for the photographs of the damaged shipment. I am sorry that the chairs
arrived with cracked legs; they were packed in our new boxes, and it seems the corner protectors were left out. We
will send a replacement set this week at no cost, and a courier will collect the damaged ones at a time that suits
you. Please let me know whether Tuesday or Wednesday morning would be better. We have also changed our packing
checklist so that this does not happen again.

With kind regards,
Daniel Meyer
Customer Service""",
    """\
In the spring of 1869, the two halves of the first railway across North America met in the Utah desert. Crews had
laid track from the west and from the east for six years, across rivers, plains and mountain passes, often in
terrible conditions. When the last spike was driven, telegraph operators sent a single word to cities across the
country: done. A journey that had taken months by wagon or by ship around the southern tip of the continent could
now be made in about a week. Trade, travel and the post were transformed, although the cost for the people whose
land the railway crossed was immense.""",
    """\
Q: Why does ice float on water?
A: Most substances are denser as solids than as liquids, but water is unusual. When it freezes, its molecules
settle into a hexagonal lattice held together by hydrogen bonds, which keeps them slightly further apart than in the
liquid. Ice is therefore about nine percent less dense than liquid water, so it floats. This matters for life:
lakes freeze from the top down, and the ice layer insulates the water beneath it, so fish survive the winter.

Q: What is the difference between weather and climate?
A: Weather is what the atmosphere does over hours or days; climate is the average pattern of weather over decades.""",
    """\
To find the area of a triangle, multiply the length of its base by its height and divide by two. For example, a
triangle with a base of 10 cm and a height of 6 cm has an area of 10 * 6 / 2 = 30 square centimetres. The formula
works because two copies of any triangle can be arranged into a parallelogram with the same base and height. For a
right triangle with legs a and b, the hypotenuse c satisfies a^2 + b^2 = c^2, so legs of 3 and 4 give c = 5.
If x + 2y = 7 and x - y = 1, subtracting the second equation from the first gives 3y = 6, so y = 2 and x = 3.""",
    """\
"Are you sure this is the right road?" asked Mira, peering at the map.
"Not at all," said her brother cheerfully. "But it's a road, and it goes somewhere."
The car bounced over another pothole. Outside, fields of sunflowers stretched to the horizon, every head turned
toward the afternoon sun. After twenty minutes they reached a village with a fountain, a closed post office and a
single café, where an old man looked up from his newspaper and pointed them back the way they had come.
"Somewhere," Mira said, "turns out to be here." They ordered two coffees and stayed until dark.""",
    """\
## Installing the tool

Run the installer from a terminal:

```sh
curl -fsSL https://example.org/install.sh -o install.sh
sh install.sh --prefix "$HOME/.local"
```

Then check that it works with `tool --version`. The configuration lives in `~/.config/tool/config.toml`:

```toml
[server]
port = 8080
log_level = "info"
```

| option | default | meaning |
|---|---|---|
| `port` | 8080 | where the server listens |
| `log_level` | info | one of debug, info, warning, error |""",
    """\
SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2023-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 5
ORDER BY revenue DESC
LIMIT 10;

function debounce(fn, delay) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), delay);
  };
}""",
    """\
Match report: City came from behind to beat Rovers 3-2 on Saturday in front of a crowd of 21,000. Rovers took the
lead after eight minutes when their captain headed in a corner, and doubled it just before half-time with a long
shot that deflected off a defender. After the break City changed their shape, pushed their full-backs forward and
pulled one back through a penalty on the hour. The equaliser came from a quick free kick, and in the last minute of
added time the substitute striker turned in the box and fired low into the corner. The win lifts City to fourth.""",
    """\
I bought this kettle three months ago and I mostly like it. It boils a full litre in a little under three minutes,
the handle stays cool, and the lid opens wide enough to clean the inside. The temperature settings are useful for
green tea. Two things annoy me: the base is so light that the cable pulls it around the counter, and the beeping
when it finishes cannot be turned off, which wakes everyone up early in the morning. Four stars out of five; I would
buy it again if it were quieter.""",
    """\
Marie Curie was born in Warsaw in 1867 and moved to Paris at the age of twenty-four to study physics and
mathematics at the Sorbonne. With her husband Pierre she studied the radiation given off by uranium ores and
discovered two new elements, polonium and radium. She was the first woman to win a Nobel Prize, and remains the only
person to have won it in two different sciences, physics in 1903 and chemistry in 1911. During the First World War
she organised mobile X-ray units that helped surgeons treat wounded soldiers near the front.""",
    """\
Tomorrow will start cloudy with patchy drizzle along the coast, clearing from the west by late morning. The
afternoon should be dry and bright, with highs of 17 to 19 degrees inland and a fresh north-westerly breeze. Tomorrow
night will be clear and cold; temperatures may fall to 3 degrees in sheltered valleys, with a risk of ground frost.
On Thursday a band of rain moves in from the Atlantic, heavy at times over the hills, with strong gusts near exposed
headlands. The weekend looks more settled.""",
    """\
fn parse_line(line: &str) -> Result<(String, u32), String> {
    let mut parts = line.splitn(2, '=');
    let key = parts.next().ok_or("missing key")?.trim().to_string();
    let value = parts
        .next()
        .ok_or_else(|| format!("no value for {key}"))?
        .trim()
        .parse::<u32>()
        .map_err(|e| e.to_string())?;
    Ok((key, value))
}

#include <stdio.h>

int main(void) {
    int total = 0;
    for (int i = 1; i <= 100; i++) {
        if (i % 3 == 0 || i % 5 == 0) total += i;
    }
    printf("%d\\n", total);
    return 0;
}""",
    """\
Once upon a time, a small fox lived at the edge of a great forest. Every night she looked at the moon and wished she
could touch it. One evening she climbed the tallest hill, but the moon was still far away. She asked the owl for
help, and the owl laughed kindly. "The moon is not for holding," he said, "but look down." Below them, in the still
water of the pond, the moon shone bright and round. The fox dipped her paw in the water, and the moon shivered and
smiled back at her. From then on, she visited the pond every night.""",
    """\
Inflation measures how quickly prices rise across an economy. When it is moderate and predictable, households and
firms can plan ahead; when it is high or erratic, savings lose value and long-term contracts become risky. Central
banks usually respond to rising inflation by raising interest rates, which makes borrowing more expensive, cools
spending and investment, and eventually slows price growth. The difficulty is timing: the effects of a rate change
take a year or more to appear fully, so policy must be set for where the economy is heading, not where it is.""",
    """\
{
  "id": 4821,
  "name": "Ada Lovelace",
  "email": "ada@example.com",
  "roles": ["admin", "editor"],
  "active": true,
  "last_login": "2024-05-17T09:42:11Z",
  "preferences": {"theme": "dark", "language": "en-GB", "notifications": false}
}

$ git status
On branch main
Changes not staged for commit:
  modified:   src/server.py
$ grep -rn "TODO" src/ | wc -l
14""",
    """\
Day three of the walk took us from the village of Arlet over the pass to the lakes. We left at dawn, climbing
through pine woods where the path was still wet with dew, and reached the treeline by nine. Above it the trail
became a series of stone steps, each one a little too high for comfort. At the top the wind was bitter, but the view
was worth every step: three lakes below us, each a different shade of blue, and beyond them a ridge of snowy peaks.
We ate our sandwiches behind a boulder and then began the long, knee-aching descent to the hut.""",
    """\
Frequently asked questions about your account

How do I reset my password? Open the sign-in page, choose "Forgot password" and enter the email address you
registered with. We will send you a link that is valid for thirty minutes.

Can I change my username? Yes, once every ninety days, from the Profile section of your settings.

What happens if I close my account? Your data is kept for thirty days in case you change your mind, and then
deleted permanently. Invoices are kept for seven years, as the law requires.""",
    """\
A sorting algorithm arranges items in order. Insertion sort builds the result one element at a time, shifting larger
elements right; it is simple and fast for short or nearly sorted lists, but takes quadratic time in the worst case.
Merge sort splits the list in half, sorts each half recursively and merges the two sorted halves, always taking
O(n log n) time at the cost of extra memory. Quicksort picks a pivot, partitions the list around it and recurses on
both sides; it is usually the fastest in practice, although a bad choice of pivot can make it quadratic.""",
)


CHAT = (
    {"role": "user", "content": "Can you explain what a hash table is, in two or three sentences?"},
    {"role": "assistant", "content": "A hash table stores key-value pairs in an array. A hash function turns each "
     "key into an index, so looking up, inserting or deleting a key usually takes constant time. When two keys land "
     "on the same index, the table resolves the collision, for example by keeping a short list at that slot."},
    {"role": "user", "content": "Thanks! And why would someone choose a tree instead?"},
    {"role": "assistant", "content": "A balanced search tree keeps its keys in order, so it can answer range "
     "queries and give the smallest or largest key quickly, and its worst case stays logarithmic, while a hash "
     "table's worst case can degrade when many keys collide."},
)
