"""The orchestrator's machines: where a campaign's engine stages compute (`runners`), the machines of a
campaign (`fleet`: start, golden replay, shards, collection, teardown), the settings audit that gates them
(`audit`) and their report (`machines_doc`: `machines.json`)."""
