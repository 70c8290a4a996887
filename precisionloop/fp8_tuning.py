"""Removed in 0.2.0: importing it says what to use instead (the test run does not collect it: see pyproject.toml)."""

raise ImportError("precisionloop.fp8_tuning was removed in 0.2.0: autotune times fp8 at FP8Policy()'s default layers "
                  "and at every layer fp8 can take, each in the whole model; FP8Policy(layers=[...]) names the layers")
