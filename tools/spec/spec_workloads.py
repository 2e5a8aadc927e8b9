"""Chat workloads for measuring speculation: three that repeat their input (edit, summarise, code
with repetition) and three that do not. The texts are written for this project."""
from __future__ import annotations

ARTICLE = """\
The town of Alderbrook built its first water tower in 1911, after a dry summer left the wells \
under the market square nearly empty. The tower held two hundred thousand litres and was filled \
each night by a steam pump beside the river. For forty years it was the tallest structure in the \
valley, and children were told that on a clear day they could see three church spires from its \
gallery. In 1956 the council replaced the steam pump with an electric one, and in 1974 a second \
reservoir was dug on the hill to the north. The old tower was kept as a landmark. Today it holds \
no water at all; its tank was cut open in 1998 and turned into a small museum about the river, \
the mills that once lined it, and the families who ran them. Visitors climb the same iron stairs \
the pump keepers used, and the gallery is open on Sundays from April to October."""

TYPOS = ARTICLE.replace("first", "frist").replace("nearly", "nearyl").replace("structure", "structrue") \
    .replace("children", "chidlren").replace("reservoir", "resevoir").replace("landmark", "landmrak") \
    .replace("museum", "musuem").replace("families", "familes").replace("Visitors", "Visiters")

CLASS = '''\
class Account:
    def __init__(self, owner, balance=0.0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))
        return self.balance

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))
        return self.balance
'''

FUNCTION = '''\
def summarize(values):
    total = 0
    count = 0
    smallest = None
    largest = None
    for x in values:
        total += x
        count += 1
        if smallest is None or x < smallest:
            smallest = x
        if largest is None or x > largest:
            largest = x
    mean = total / count if count else 0
    return {"total": total, "count": count, "mean": mean, "min": smallest, "max": largest}
'''

WORKLOADS: dict[str, tuple[bool, str]] = {  # name -> (repetitive, user message)
    "edit": (True, "Rewrite the following text with the spelling mistakes corrected. Change nothing else.\n\n"
             + TYPOS),
    "summarise": (True, "Summarise the following text in a few sentences.\n\n" + ARTICLE),
    "code-extend": (True, "Add a `transfer(self, other, amount)` method and a `statement(self)` method to this "
                    "class, in the same style, and show the whole class.\n\n```python\n" + CLASS + "```"),
    "code-rename": (True, "Rename the variable `x` to `value` in this function and show the whole function.\n\n"
                    "```python\n" + FUNCTION + "```"),
    "story": (False, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "explain": (False, "Explain how vaccines train the immune system, for a curious teenager."),
    "advice": (False, "Give practical advice to someone starting to learn the piano as an adult."),
}
