"""`plait coexec run` and `plait coexec profile`: co-execution measured on a small model written
by hand, the fixture the planner's predictions are checked against.

`run` runs it (sequential, co-executed, with FiCCO, planned from measured costs); the model is
`small_model` (`values`, `units`, `experts`: its units and their hand-derived backward), run by
`trainer`. What users run co-executed is `plait.pipelining` on the strands engine
(`plait.runtime.strands`); this fixture stays because its units are the planner's units one for
one, so a plan can be checked unit by unit.
"""
