"""Running florist between real processes: local federations, certificates, edge boxes."""
