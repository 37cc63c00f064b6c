from plait.cli.main import app

app()
