"""backends/container"""
