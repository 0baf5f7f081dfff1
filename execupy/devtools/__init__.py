"""Developer tools: program summaries, ETRecord/ETDump, Inspector, bundled programs."""
