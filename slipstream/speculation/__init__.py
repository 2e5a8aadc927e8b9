"""Speculative decoding, in one room (docs/speculative.md): the policy that plans drafts per row
(policy.py, pure Python: the scheduler's), the drafters and their registry (drafter.py, registry.py,
ngram_drafter.py, draft_model_drafter.py), the token history they read (history.py), verification
(verify.py) and the speculating step on the device (runner.py, which the ModelRunner holds). This
package imports nothing at import time: the scheduler imports policy.py without torch."""
