"""tvmpipe.deploy"""
