"""The run dir read back and analysed: load, model, analysis, the Markdown report, the plots
and the one-screen summary. Pure apart from loading. May import `contracts` and
`supervisor.log`."""
