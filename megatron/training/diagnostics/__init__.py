"""Run diagnostics: how errors end a run, hang dumps with the last collectives, straggler reports."""
