"""Co-execution planning (DHelix): the DP plan, its block costs, the variants of a step, and
the pipelined step."""
